"""pv.clip_per_sample and pv.dp_sgd_gradient: per-sample clipping over all parameters jointly, DP-SGD noise."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.derived import clipping
from pergrad_viz.derived.clipping import EPS


def grads_dict() -> dict[str, torch.Tensor]:
    """B = 6 samples with norms from tiny to large, as {name: (B, *shape)}."""
    g = torch.Generator().manual_seed(0)
    scale = torch.tensor([1e-3, 0.1, 0.9, 1.5, 10.0, 300.0], dtype=torch.float64)
    shapes = {"w": (3, 4), "b": (3,), "v": (2, 2, 2)}
    raw = {n: torch.randn(6, *s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    norms = torch.sqrt(sum(t.flatten(1).square().sum(1) for t in raw.values()))
    return {n: t * (scale / norms).view(-1, *(1,) * len(shapes[n])) for n, t in raw.items()}


def flatten(d: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.flatten(1) for t in d.values()], dim=1)


def test_worked_example():
    g = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]])
    clipped, norms = pv.clip_per_sample(g, 1.0)
    torch.testing.assert_close(norms, torch.tensor([5.0, 0.5, 0.0]))
    torch.testing.assert_close(clipped, torch.tensor([[0.6, 0.8], [0.3, 0.4], [0.0, 0.0]]), rtol=1e-6, atol=1e-6)
    assert torch.equal(clipped[1:], g[1:])


@pytest.mark.parametrize("max_norm", [0.05, 1.0, 50.0])
def test_flat_clipping(max_norm):
    g = flatten(grads_dict())
    before = g.clone()
    clipped, norms = pv.clip_per_sample(g, max_norm)
    assert torch.equal(g, before)  # the input is not modified
    torch.testing.assert_close(norms, torch.linalg.norm(g, dim=1))
    after = torch.linalg.norm(clipped, dim=1)
    assert (after <= max_norm * (1 + 1e-9)).all()
    under = norms + EPS < max_norm
    assert under.any() and (~under).any()
    assert torch.equal(clipped[under], g[under])  # within the bound: unchanged
    # Clipped samples keep their direction and land on the bound (up to the 1e-6 in the factor).
    cos = (clipped * g).sum(1) / (after * norms)
    torch.testing.assert_close(cos, torch.ones_like(cos))
    torch.testing.assert_close(after[~under], torch.full_like(after[~under], max_norm), rtol=1e-5, atol=0)
    factor = torch.clamp(max_norm / (norms + EPS), max=1.0)
    torch.testing.assert_close(clipped, g * factor[:, None])


def test_dict_and_flat_give_the_same_numbers():
    d = grads_dict()
    clipped_d, norms_d = pv.clip_per_sample(d, 1.0)
    clipped_f, norms_f = pv.clip_per_sample(flatten(d), 1.0)
    assert list(clipped_d) == list(d) and all(clipped_d[n].shape == d[n].shape for n in d)
    torch.testing.assert_close(norms_d, norms_f, rtol=1e-12, atol=0)
    torch.testing.assert_close(flatten(clipped_d), clipped_f, rtol=1e-12, atol=0)
    # Jointly over all parameters, not per parameter: each entry alone is under its share.
    per_param = {n: torch.linalg.norm(t.flatten(1), dim=1) for n, t in clipped_d.items()}
    joint = torch.sqrt(sum(v.square() for v in per_param.values()))
    assert (joint <= 1.0 + 1e-9).all() and (joint[3:] > 0.999).all()


def test_clips_the_output_of_per_sample_grads():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    x, y = torch.randn(5, 4) * 10, torch.tensor([0, 1, 1, 0, 1])
    grads = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    clipped, norms = pv.clip_per_sample(grads, 0.1)
    torch.testing.assert_close(norms, pv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, y))
    assert (torch.linalg.norm(flatten(clipped), dim=1) <= 0.1 * (1 + 1e-6)).all()


@pytest.mark.parametrize("bad", [0, -1.0, math.nan, math.inf, True, "1", None, torch.tensor([1.0, 2.0])])
def test_max_norm_must_be_a_positive_number(bad):
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        pv.clip_per_sample(flatten(grads_dict()), bad)
    with pytest.raises(ValueError, match="max_norm must be a finite number > 0"):
        pv.dp_sgd_gradient(grads_dict(), bad, 1.0)


def test_bad_gradients_name_the_fix():
    with pytest.raises(ValueError, match=r"\(B, P\) tensor.*flat=True"):
        pv.clip_per_sample(torch.ones(5), 1.0)
    with pytest.raises(ValueError, match=r"\(B, P\) tensor"):
        pv.clip_per_sample(torch.ones(5, 3, dtype=torch.long), 1.0)
    with pytest.raises(ValueError, match="empty dict"):
        pv.clip_per_sample({}, 1.0)
    with pytest.raises(ValueError, match="same samples first"):
        pv.clip_per_sample({"a": torch.ones(5, 3), "b": torch.ones(4, 3)}, 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        pv.clip_per_sample({"a": torch.ones(5, 3), "b": torch.ones(5, 3, dtype=torch.float64)}, 1.0)
    with pytest.raises(TypeError, match="grads must be a"):
        pv.clip_per_sample([torch.ones(5, 3)], 1.0)


def test_dp_sgd_without_noise_is_the_sum_of_clipped_gradients():
    d = grads_dict()
    clipped, _ = pv.clip_per_sample(d, 0.5)
    out = pv.dp_sgd_gradient(d, 0.5, 0.0)
    assert list(out) == list(d)
    for n in d:
        assert out[n].shape == d[n].shape[1:]
        assert torch.equal(out[n], clipped[n].sum(0))
    flat = pv.dp_sgd_gradient(flatten(d), 0.5, 0)
    assert flat.shape == (flatten(d).shape[1],)
    torch.testing.assert_close(flat, flatten({n: t.unsqueeze(0) for n, t in out.items()})[0])


def test_dp_sgd_noise_is_seeded_and_has_the_right_scale():
    g = torch.zeros(3, 40_000, dtype=torch.float64)
    g[:, 0] = 5.0
    a = pv.dp_sgd_gradient(g, 2.0, 1.5, generator=torch.Generator().manual_seed(7))
    b = pv.dp_sgd_gradient(g, 2.0, 1.5, generator=torch.Generator().manual_seed(7))
    c = pv.dp_sgd_gradient(g, 2.0, 1.5, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    noise = a[1:]  # the clipped gradients are zero there
    assert abs(noise.std().item() - 1.5 * 2.0) < 0.05 * 3.0
    assert abs(noise.mean().item()) < 0.05
    # coordinate 0: 3 samples clipped from 5 to 2 each, plus noise of std 3
    assert abs(a[0].item() - 6.0) < 5 * 3.0
    d = {"w": torch.zeros(3, 100, 100, dtype=torch.float64), "b": torch.zeros(3, 50, dtype=torch.float64)}
    out = pv.dp_sgd_gradient(d, 1.0, 2.0, generator=torch.Generator().manual_seed(0))
    again = pv.dp_sgd_gradient(d, 1.0, 2.0, generator=torch.Generator().manual_seed(0))
    assert all(torch.equal(out[n], again[n]) for n in d)
    assert abs(out["w"].std().item() - 2.0) < 0.1 and not torch.equal(out["w"].flatten()[:50], out["b"])


def test_dp_sgd_invalid_arguments():
    g = flatten(grads_dict())
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        pv.dp_sgd_gradient(g, 1.0, -0.1)
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        pv.dp_sgd_gradient(g, 1.0, math.nan)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        pv.dp_sgd_gradient(g, 1.0, 1.0, generator=0)


def _half_problem():
    torch.manual_seed(0)
    model = nn.Linear(64, 3).half()
    x, t = (torch.randn(5, 64) * 2000).half(), torch.randn(5, 3).half()
    return model, nn.L1Loss(reduction="sum"), x, t


def _definition(model, loss_fn, x, t, bound):
    """(rows (B, P) float64 of the model as it is, clipped sum (P,) float64): one backward per sample."""
    rows = torch.stack([torch.cat([g.flatten().double() for g in torch.autograd.grad(
        loss_fn(model(x[i:i + 1]), t[i:i + 1]), list(model.parameters()))]) for i in range(x.shape[0])])
    factors = (bound / (rows.norm(dim=1) + EPS)).clamp(max=1)
    return rows, (rows * factors[:, None]).sum(0)


def test_float16_clip_factors_below_its_range_are_refused_or_applied_in_float32():
    """Found by a probe: with gradient norms near 3e4 and max_norm=1e-3 the float16 clip factor (3e-8) was a
    subnormal number: clipped_grad_sum 67% off, clip_per_sample's rows of norm up to 1.95e-3 (the DP bound broken)."""
    model, loss_fn, x, t = _half_problem()
    rows, want = _definition(model, loss_fn, x, t, 1e-3)
    clipped, _ = pv.clip_per_sample(rows.half(), 1e-3)  # the product in float32, rounded once
    assert clipped.dtype == torch.float16
    assert clipped.double().norm(dim=1).max() <= 1e-3 * (1 + 2e-3)
    torch.testing.assert_close(clipped.double().sum(0), want, rtol=0, atol=2e-3 * want.abs().max().item())
    with pytest.raises(ValueError, match=r"below float16's smallest normal number.*model.to\(torch.bfloat16\)"):
        pv.clipped_grad_sum(model, loss_fn, x, t, 1e-3)
    model.to(torch.bfloat16)  # the fix it names
    x = x.to(torch.bfloat16)
    t = t.to(torch.bfloat16)
    _, want = _definition(model, loss_fn, x, t, 1e-3)
    got = torch.cat([s.flatten().double() for s in pv.clipped_grad_sum(model, loss_fn, x, t, 1e-3).values()])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())


def test_float32_clip_factors_below_its_range_are_refused_and_ordinary_ones_read_nothing(monkeypatch):
    """Found by a probe: max_norm=1e-44 in float32 gave a clipped sum 44% off (1e-46: all zeros), the factor C / norm
    a subnormal number; refused now, as float16's. Where the batch's total squared norm rules it out (every ordinary
    call) the factors are not read from the device at all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    with pytest.raises(ValueError, match=r"below float32's smallest normal number.*larger max_norm"):
        pv.clipped_grad_sum(model, loss_fn, x, y, 1e-44)
    with pytest.raises(ValueError, match=r"norm of over 1e308 times max_norm"):  # a factor 0 even in float64 (a review:
        pv.clipped_grad_sum(model, lambda o, t: loss_fn(o, t) * 1e30, x, y, 1e-300)  # ZeroDivisionError)
    rows, want = _definition(model.double(), loss_fn, x.double(), y, 1e-30)
    model.float()
    got = torch.cat([s.flatten().double() for s in pv.clipped_grad_sum(model, loss_fn, x, y, 1e-30).values()])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())

    def never(*args):
        raise AssertionError("the factors were read")

    monkeypatch.setattr(clipping, "_check_narrow_factors", never)
    pv.clipped_grad_sum(model, loss_fn, x, y, 1e-30)
    pv.clipped_grad_sum(model.half(), loss_fn, x.half(), y, 1.0)


def test_a_sample_whose_loss_alone_is_0_over_0_is_named_with_a_fix_that_works():
    """Found by a probe: CrossEntropyLoss(weight=...) with a class weight of 0 under reduction='mean' makes that
    class's samples' loss 0/0 alone (the loop's row is NaN); the refusal's only fix, keeping the finite inputs, kept
    every row."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x, y, w = torch.randn(6, 8), torch.tensor([0, 1, 2, 2, 1, 0]), torch.tensor([0.0, 1.0, 2.0])
    with pytest.raises(ValueError, match=r"sample\(s\) \[0, 5\].*0 / 0.*reduction='sum'"):
        pv.clipped_grad_sum(model, nn.CrossEntropyLoss(weight=w), x, y, 1.0)
    loss_fn = nn.CrossEntropyLoss(weight=w, reduction="sum")  # the fix it names
    got = pv.clipped_grad_sum(model, loss_fn, x, y, 1.0)
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters())) for i in range(6)]
    norms = torch.stack([torch.sqrt(sum(g.square().sum() for g in r)) for r in rows])
    factors = (1.0 / (norms + EPS)).clamp(max=1)
    for k, name in enumerate(got):
        torch.testing.assert_close(got[name], sum(f * r[k] for f, r in zip(factors, rows, strict=True)))
