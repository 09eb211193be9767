"""Float32 gradients that are large, not infinite: a per-sample norm above 1.8e19 squares to inf in float32. The
norms and the clipped sum take it as the number it is (a sample clipped to C, not dropped from the sum), against a
loop written here: float32 per-sample gradients by one backward each, their norms and clipped sum in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pergrad_viz as pv

SCALE = 1e25  # the loss's scale: every gradient about this large, its square far past float32's 3.4e38


class Tokens(nn.Module):
    """Embedding -> LayerNorm -> Linear over 6 tokens (the Gram form, scaled) -> mean -> head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 8)
        self.norm = nn.LayerNorm(8)
        self.mix = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids):
        return self.head(self.mix(self.norm(self.embed(ids))).mean(1))


class TiedLM(nn.Module):
    """An Embedding tied to the output Linear (GPT-2's wte / lm_head): the tied weight's norm from its cross terms."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(25, 12)
        self.out = nn.Linear(12, 25, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids))).mean(1)[:, :3]


def _cases():
    torch.manual_seed(0)
    yield "mlp", nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)), torch.randn(6, 5)
    yield "cnn", nn.Sequential(nn.Conv2d(1, 3, 3), nn.ReLU(), nn.Flatten(), nn.Linear(3 * 4 * 4, 3)), \
        torch.randn(6, 1, 6, 6)
    yield "tokens", Tokens(), torch.randint(0, 20, (6, 6))
    yield "tied", TiedLM(), torch.randint(0, 25, (6, 6))


CASES = {name: (model, x) for name, model, x in _cases()}


def huge_loss(output, target):
    return SCALE * F.cross_entropy(output, target, reduction="sum")


def one_huge_loss(output, target):
    """Class 2's samples' losses times 1e22, the others' as they are: one huge sample among ordinary ones."""
    weights = torch.where(target == 2, 1e22, 1.0)
    return (weights * F.cross_entropy(output, target, reduction="none")).sum()


def _loop_grads(model, x, y, loss_fn=huge_loss) -> torch.Tensor:
    """(B, P) float32 per-sample gradients, one backward per sample."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func"])
@pytest.mark.parametrize("name", list(CASES))
def test_norms_past_float32_squares(name, strategy):
    model, x = CASES[name]
    y = torch.arange(x.shape[0]) % 3
    grads = _loop_grads(model, x, y)
    assert grads.isfinite().all()
    want = torch.linalg.vector_norm(grads.double(), dim=1)
    assert (want > 1e20).all()  # every square past float32's range
    got = pv.per_sample_grad_norms(model, huge_loss, x, y, strategy=strategy)
    assert got.dtype == torch.float32 and got.isfinite().all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("loss_fn", [huge_loss, one_huge_loss])
@pytest.mark.parametrize("name", list(CASES))
def test_a_clipped_sum_keeps_samples_past_float32_squares(name, loss_fn):
    model, x = CASES[name]
    y = torch.tensor([0, 2, 1, 0, 1, 0]) if loss_fn is one_huge_loss else torch.arange(x.shape[0]) % 3
    grads = _loop_grads(model, x, y, loss_fn).double()
    norms = torch.linalg.vector_norm(grads, dim=1)
    assert norms.max() > 1e20 and (loss_fn is huge_loss or norms.min() < 1e3)
    want = (grads * (1.0 / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0)  # each sample clipped to C = 1
    got, got_norms = pv.clipped_grad_sum(model, loss_fn, x, y, max_norm=1.0, return_norms=True)
    assert got_norms.dtype == torch.float32  # as the gradients (the squares are float64 inside)
    torch.testing.assert_close(got_norms.double(), norms, rtol=1e-4, atol=1e-6)
    flat = torch.cat([got[n].reshape(-1) for n, p in model.named_parameters() if p.requires_grad]).double()
    assert flat.isfinite().all()
    torch.testing.assert_close(flat, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("flat", [False, True])
def test_clip_per_sample_of_gradients_past_float32_squares(flat):
    model, x = CASES["mlp"]
    y = torch.arange(x.shape[0]) % 3
    grads = _loop_grads(model, x, y)
    want = torch.linalg.vector_norm(grads.double(), dim=1)
    given = pv.per_sample_grads(model, huge_loss, x, y, flat=flat)
    clipped, norms = pv.clip_per_sample(given, 1.0)
    torch.testing.assert_close(norms.double(), want, rtol=1e-4, atol=0)
    rows = clipped if flat else torch.cat([clipped[n].flatten(1) for n, _ in model.named_parameters()], 1)
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows.double(), grads.double() / want[:, None], rtol=1e-4, atol=1e-6)


def test_a_scan_of_gradients_past_float32_squares(tmp_path):
    model, x = CASES["tokens"]
    y = torch.arange(x.shape[0]) % 3
    want = torch.linalg.vector_norm(_loop_grads(model, x, y).double(), dim=1)
    res = pv.scan(model, huge_loss, torch.utils.data.TensorDataset(x, y), quantities=("grad_norm",), batch_size=3,
                  out=tmp_path / "s", progress=False)
    got = torch.as_tensor(res["grad_norm"]).double()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=0)


def test_the_checks_reference_norms_past_float32_squares():
    """The per-call check's reference norm (one backward) is finite where the gradient is: an inf reference would
    let any result pass, NaN included."""
    from pergrad_viz.engine.references import norms_of_grads

    model, x = CASES["tied"]
    y = torch.arange(x.shape[0]) % 3
    params = tuple(p for p in model.parameters() if p.requires_grad)
    got = norms_of_grads(huge_loss(model(x[:1]), y[:1]), params)
    want = torch.linalg.vector_norm(_loop_grads(model, x[:1], y[:1]).double(), dim=1)
    assert len(got) == 1 and got[0].dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want, rtol=1e-5, atol=0)


@pytest.mark.parametrize("big", [1e160, 1e200])
def test_a_saturated_sample_with_a_huge_input_keeps_a_finite_norm(big):
    """A float64 input row of 1e160 through tanh: the output gradient is 0 there, the activation's norm squared
    overflows even float64; the weight's norm is ||g|| ||a|| (0 * huge = 0), not inf * 0 = NaN, which made every
    entry of the clipped sum NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1])
    x[3] = big
    loss = nn.CrossEntropyLoss()
    params = list(model.parameters())
    grads = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]),
                                                                               params)]) for i in range(5)])
    norms = grads.norm(dim=1)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss, x, y), norms)
    got = pv.clipped_grad_sum(model, loss, x, y, 0.05)
    want = (grads * (0.05 / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    torch.testing.assert_close(torch.cat([got[n].reshape(-1) for n, _ in model.named_parameters()]), want)
