"""Shared test helpers: reference loops written independently of pergrad_viz, model-state snapshots, the check
that a figure's parts stay inside it."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.modules import module as _module_mod

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def ref_grads(model: nn.Module, loss_fn, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample gradients by the definition: one forward and one backward per sample."""
    named = trainable(model)
    rows = []
    for i in range(x.shape[0]):
        loss = loss_fn(model(x[i:i + 1]), y[i:i + 1])
        g = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        rows.append([torch.zeros_like(p) if gi is None else gi for gi, (_, p) in zip(g, named, strict=True)])
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def in_batch_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample gradients of the cross-entropy from one forward of the whole batch, each sample's loss
    differentiated alone: what the batch's kernels give each sample (the loop's values where the samples do not
    interact, up to those kernels' rounding)."""
    named = trainable(model)
    losses = nn.functional.cross_entropy(model(x), y, reduction="none")
    rows = [torch.autograd.grad(losses[i], [p for _, p in named], retain_graph=True) for i in range(x.shape[0])]
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(named)}


def ref_jacobian(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-sample output Jacobians by the definition: a double loop over samples and output elements."""
    named = trainable(model)
    per_sample = []
    for i in range(x.shape[0]):
        out = model(x[i:i + 1]).reshape(-1)
        per_out = []
        for j in range(out.numel()):
            g = torch.autograd.grad(out[j], [p for _, p in named], retain_graph=True, allow_unused=True)
            per_out.append([torch.zeros_like(p) if gi is None else gi for gi, (_, p) in zip(g, named, strict=True)])
        per_sample.append({n: torch.stack([r[k] for r in per_out]) for k, (n, _) in enumerate(named)})
    return {n: torch.stack([s[n] for s in per_sample]) for n, _ in named}


def flatten_ref(ref: dict[str, torch.Tensor], lead: int) -> torch.Tensor:
    """torch.cat of the dict's values, each flattened after its first ``lead`` dimensions."""
    return torch.cat([t.reshape(*t.shape[:lead], -1) for t in ref.values()], dim=-1)


def assert_dict_close(got, want: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert isinstance(got, dict), f"expected a dict, got {type(got).__name__}"
    assert list(got) == list(want), f"keys/order differ: {list(got)} vs {list(want)}"
    for name, w in want.items():
        g = got[name]
        assert g.shape == w.shape, f"{name}: shape {tuple(g.shape)} vs {tuple(w.shape)}"
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} vs {w.dtype}"
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, name=name: f"{name}: {m}")


# ----------------------------------------------------------------------------------------------- state

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def hook_state(model: nn.Module) -> dict:
    """Every hook registered on the model's modules and parameters (and globally), by key."""
    state = {}
    for name, m in model.named_modules():
        for attr in _HOOK_DICTS:
            d = getattr(m, attr, None)
            if d is not None:
                state[(name, attr)] = list(d.keys())
    for name, p in model.named_parameters():
        for attr in ("_backward_hooks", "_post_accumulate_grad_hooks"):
            d = getattr(p, attr, None)
            state[(name, attr)] = [] if d is None else list(d.keys())
    for attr in _GLOBAL_HOOKS:
        d = getattr(_module_mod, attr, None)
        if d is not None:
            state[("<global>", attr)] = list(d.keys())
    return state


def assert_no_hooks(model: nn.Module) -> None:
    leftover = {k: v for k, v in hook_state(model).items() if v}
    assert not leftover, f"hooks left behind: {leftover}"


def snapshot(model: nn.Module) -> dict:
    return {
        "params": {n: (p.detach().clone(), p.requires_grad) for n, p in model.named_parameters()},
        "param_ids": {n: id(p) for n, p in model.named_parameters()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "grad_objects": {n: p.grad for n, p in model.named_parameters()},
        "buffers": {n: None if b is None else b.clone() for n, b in model.named_buffers()},
        "training": {n: m.training for n, m in model.named_modules()},
        "hooks": hook_state(model),
        "attributes": {n: sorted(vars(m)) for n, m in model.named_modules()},  # e.g. no instance forward left
    }


def assert_state_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["param_ids"] == before["param_ids"], "parameters were replaced"
    for n, (p, rg) in before["params"].items():
        q, rg2 = after["params"][n]
        assert rg == rg2, f"{n}: requires_grad changed"
        assert torch.equal(p, q), f"{n}: parameter values changed"
    for n, g in before["grads"].items():
        g2 = after["grads"][n]
        if g is None:
            assert g2 is None, f"{n}: .grad was None and is now set"
        else:
            assert g2 is not None and torch.equal(g, g2), f"{n}: .grad changed"
    for n, obj in before["grad_objects"].items():
        assert after["grad_objects"][n] is obj, f"{n}: .grad replaced"
    assert list(after["buffers"]) == list(before["buffers"])
    for n, b in before["buffers"].items():
        assert torch.equal(b, after["buffers"][n]), f"buffer {n} changed"
    assert after["training"] == before["training"], "training flags changed"
    assert after["hooks"] == before["hooks"], "hooks changed"
    assert after["attributes"] == before["attributes"], "module attributes added or removed"


def empty_out(module: nn.Module, n: int, batch: int, dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """NaN-filled (N, B, *param.shape) views into one flat (N, B, P) result, as the hooks strategy passes them to
    a rule (trainable parameters only)."""
    named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    flat = torch.full((n, batch, sum(p.numel() for _, p in named)), float("nan"), dtype=dtype)
    out, start = {}, 0
    for name, p in named:
        out[name] = flat[:, :, start:start + p.numel()].view(n, batch, *p.shape)
        start += p.numel()
    return out


# --------------------------------------------------------------------------------------------- figures


def outside(fig: Figure) -> list[str]:
    """Axes (with everything drawn on them: labels, titles, annotations, legends) and figure texts that reach
    beyond the figure, after drawing it as it is saved."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    width, height = fig.bbox.width, fig.bbox.height
    parts = [(f"axes {k} ({ax.get_title()[:30]!r})", ax.get_tightbbox(renderer)) for k, ax in enumerate(fig.axes)]
    texts = [t for t in [*fig.texts, fig._suptitle] if t is not None and t.get_visible() and t.get_text().strip()]
    parts += [(repr(t.get_text()[:40]), t.get_window_extent(renderer)) for t in texts]
    bad = []
    for what, box in parts:
        if box is not None and (box.x0 < -1 or box.y0 < -1 or box.x1 > width + 1 or box.y1 > height + 1):
            bad.append(f"{what}: {box.x0:.0f}..{box.x1:.0f} x {box.y0:.0f}..{box.y1:.0f} "
                       f"(figure {width:.0f} x {height:.0f})")
    return bad


# ------------------------------------------------------------------------------------------- refusals


def process_state() -> tuple:
    """What a call must leave as it found in the user's process: the global RNG, grad mode, inference mode."""
    return torch.get_rng_state(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def assert_process_unchanged(before: tuple) -> None:
    rng, grad, inference = process_state()
    assert torch.equal(rng, before[0]), "the global RNG was drawn from"
    assert (grad, inference) == before[1:], f"grad / inference mode changed: {before[1:]} -> {(grad, inference)}"


def assert_refuses(call, model: nn.Module, *fragments: str, error: type[BaseException] = ValueError
                   ) -> BaseException:
    """``call()`` raises ``error`` whose message holds every fragment, leaving ``model`` (parameters, ``.grad``,
    buffers, modes, hooks) and the process (RNG, grad mode) as they were."""
    import pytest

    before, process = snapshot(model), process_state()
    with pytest.raises(error) as info:
        call()
    msg = str(info.value)
    missing = [f for f in fragments if f not in msg]
    assert not missing, f"the message does not name {missing}: {msg!r}"
    assert_state_unchanged(model, before)  # hooks too: none added, the user's own kept
    assert_process_unchanged(process)
    return info.value


def per_sample_call(quantity: str, model: nn.Module, x, y, strategy: str, flat: bool):
    """``pv.per_sample_grads`` with cross-entropy (``quantity`` "grads") or ``pv.per_sample_jacobian``, as asked."""
    import pergrad_viz as pv

    if quantity == "grads":
        return pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy=strategy, flat=flat)
    return pv.per_sample_jacobian(model, x, strategy=strategy, flat=flat)


def counting_calls(monkeypatch, owner: object, name: str, real=None) -> list:
    """Replace ``owner.name`` (through ``monkeypatch``) by a wrapper that calls ``real`` (default: the attribute as it
    was) and notes each call; returns the list the calls are noted in."""
    calls: list = []
    real = getattr(owner, name) if real is None else real

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


class TwoDtypes(nn.Module):
    """A float32 layer, then a float64 one, the forward casting between them: (B, 6) -> (B, 3)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 3).double()

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)).double())


def forked_result(target, *args, seconds: float = 30) -> object:
    """What ``target(*args, queue)`` puts on its queue, run in a child forked now; an AssertionError where the child
    is still running after ``seconds`` (it waits on a lock the parent's threads hold). ``target`` must put values
    that pickle by value (a list, not a tensor: a tensor is sent as a file descriptor the finished child closes)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=target, args=(*args, queue))
    child.start()
    child.join(timeout=seconds)
    hung = child.is_alive()
    if hung:
        child.kill()
    assert not hung, "the forked child hung (a lock the parent's threads held?)"
    return queue.get(timeout=10)
