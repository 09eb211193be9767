"""The floor of book-keeping DP-SGD in eager PyTorch on a CPU: the fewest operations the algorithm itself needs, written
by hand for two models made of Linear and LayerNorm layers only, timed against a plain forward+backward and
``pv.clipped_grad_sum`` (interleaved rounds, medians; under the heap settings of a warm training loop, as
``bench --dp`` times).

The hand-written step keeps each layer's input in a forward hook, takes its ghost norm in a tensor hook as its output
gradient arrives (a Linear on T tokens: ``sum_{t,s} (a_t . a_s)(g_t . g_s)`` from two (B, T, T) Grams; T = 1:
``||g||^2 ||a||^2``; a LayerNorm: its (B, D) per-sample gradients), and after one backward to the layer outputs adds
each layer's share with the clip factors, ``(c G)^T A``: no checks, no range handling, no other layer types, nothing
the package's contract asks for. What it costs over a plain step is what book-keeping costs here before any of that.

    python tools/dp_floor.py [--rounds 100] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import pergrad_viz as pv
from pergrad_viz.bench.dp import _allocator, dp_problem


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d: int = 64, heads: int = 4, feedforward: int = 128):
        super().__init__()
        self.attention, self.norm1 = _Attention(d, heads), nn.LayerNorm(d)
        self.up, self.down, self.norm2 = nn.Linear(d, feedforward), nn.Linear(feedforward, d), nn.LayerNorm(d)

    def forward(self, x):
        x = self.norm1(x + self.attention(x))
        return self.norm2(x + self.down(F.relu(self.up(x))))


class LinearTransformer(nn.Module):
    """``bench --dp``'s transformer (2 post-norm layers, d_model 64, 4 heads, feed-forward 128, a Linear head on the
    mean over 16 tokens) with its attention made of two Linears."""

    def __init__(self):
        super().__init__()
        self.blocks, self.head = nn.Sequential(_Block(), _Block()), nn.Linear(64, 10)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))


def floor_step(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor, bound: float) -> dict:
    """The clipped sum {module: (weight sum, bias sum)}, book-keeping at its leanest."""
    booked, outputs, squares = [], [], []

    def keep(module, inputs, output):
        a, entry = inputs[0].detach(), [module, inputs[0].detach(), None, None]
        booked.append(entry)
        outputs.append(output)

        def norms(g):
            if isinstance(module, nn.LayerNorm):
                g_weight = (g * F.layer_norm(a, module.normalized_shape, eps=module.eps)).sum(1)
                entry[2:] = g_weight, g.sum(1)
                squares.extend((g_weight.square().sum(1), entry[3].square().sum(1)))
            elif a.dim() == 2:
                g_square = g.square().sum(1)
                entry[2] = g
                squares.extend((g_square * a.square().sum(1), g_square))
            else:
                grams = torch.bmm(g, g.mT)
                entry[2] = g
                squares.extend((torch.linalg.vecdot(torch.bmm(a, a.mT).flatten(1), grams.flatten(1)),
                                grams.sum((1, 2))))

        output.register_hook(norms)

    handles = [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, nn.Linear | nn.LayerNorm)]
    try:
        loss = loss_fn(model(x), y)
    finally:
        for h in handles:
            h.remove()
    torch.autograd.grad(loss, outputs[0])
    outputs.clear()  # the outputs let go: their gradients were all taken
    c = (bound / (torch.stack(squares).sum(0).sqrt() + 1e-6)).clamp(max=1.0)
    sums = {}
    for module, a, g, g_bias in booked:
        if isinstance(module, nn.LayerNorm):
            sums[module] = torch.mv(g.mT, c), torch.mv(g_bias.mT, c)
        else:
            rows_a, rows_g = a.reshape(-1, a.shape[-1]), g.reshape(-1, g.shape[-1])
            per_row = c.repeat_interleave(rows_a.shape[0] // c.shape[0])
            sums[module] = torch.mm(rows_g.mT, rows_a * per_row[:, None]), torch.mv(rows_g.mT, per_row)
    return sums


def measure(name: str, model: nn.Module, loss_fn, x, y, rounds: int) -> None:
    params = [p for p in model.parameters() if p.requires_grad]

    def plain():
        for p in params:
            p.grad = None
        loss_fn(model(x), y).backward()

    want = pv.clipped_grad_sum(model, loss_fn, x, y, 1.0)
    got = floor_step(model, loss_fn, x, y, 1.0)
    names = {m: n for n, m in model.named_modules()}
    diff = max(max(float((got[m][0] - want[f"{names[m]}.weight"]).abs().max()),
                   float((got[m][1] - want[f"{names[m]}.bias"]).abs().max())) for m in got)
    methods = {"forward+backward": plain, "hand-written floor": lambda: floor_step(model, loss_fn, x, y, 1.0),
               "pv clipped_grad_sum": lambda: pv.clipped_grad_sum(model, loss_fn, x, y, 1.0),
               "pv, verify=False": lambda: pv.clipped_grad_sum(model, loss_fn, x, y, 1.0, verify=False)}
    for f in methods.values():
        for _ in range(5):
            f()
    times = {k: [] for k in methods}
    for r in range(rounds):
        order = list(methods.items())
        for k, f in order[r % len(order):] + order[:r % len(order)]:
            start = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - start)
    base = statistics.median(times["forward+backward"])
    print(f"## {name}, B={x.shape[0]} (floor's max |diff| from pv: {diff:.1e})")
    for k, v in times.items():
        q = statistics.quantiles(v, n=4)
        print(f"{k:22s} {statistics.median(v) * 1e3:7.3f} ms  IQR {100 * (q[2] - q[0]) / statistics.median(v):3.0f}%"
              f"  {statistics.median(v) / base:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _allocator(measuring_memory=False)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = LinearTransformer().eval()
    x, y = torch.randn(32, 16, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    print(f"# book-keeping's floor: {args.threads} threads, torch {torch.__version__}, medians of {args.rounds} "
          "interleaved rounds")
    measure("transformer of Linears", model, nn.CrossEntropyLoss(reduction="sum"), x, y, args.rounds)
    mlp, loss_fn, x, y = dp_problem("mlp", 32)
    measure("mlp (784, 512, 10)", mlp, loss_fn, x, y, args.rounds)


if __name__ == "__main__":
    main()
