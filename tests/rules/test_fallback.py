"""The per-layer fallback's short path (pergrad_viz.rules.fallback): layers whose parameters enter only elementwise
get their per-sample gradients from one batched backward on per-sample parameter copies, once their first call
with B >= 2 agreed with the vmap path; every call, short path or not, equals the plain loop of tests/helpers.py."""

from __future__ import annotations

import pytest
import torch
from helpers import ref_grads, ref_jacobian
from torch import nn

import pergrad_viz as pv
from pergrad_viz.rules import fallback

DT = torch.float64


class ScaleShift(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n, dtype=DT))
        self.bias = nn.Parameter(torch.linspace(-0.2, 0.3, n, dtype=DT))

    def forward(self, x):
        return x * self.weight + self.bias


class Gated(nn.Module):
    """A parameter used in the forward of a layer with a child."""

    def __init__(self, n: int):
        super().__init__()
        self.fc = nn.Linear(n, n, dtype=DT)
        self.gate = nn.Parameter(torch.linspace(0.1, 0.9, n, dtype=DT))

    def forward(self, x):
        return x + self.gate * torch.tanh(self.fc(x))


class FlipScale(nn.Module):
    """Elementwise for one sample, but the copies' rows are used in reverse (as a permutation inside a layer
    would): the short path would give sample b the gradient of sample B-1-b, so it must never be taken."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n, dtype=DT))

    def forward(self, x):
        return x * self.weight.expand(x.shape[0], -1).flip(0)


def _model(layer: nn.Module) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5, dtype=DT), nn.Tanh(), layer, nn.Tanh(), nn.Linear(5, 3, dtype=DT))


def _data(batch: int = 5):
    g = torch.Generator().manual_seed(batch)
    return torch.randn(batch, 4, generator=g, dtype=DT), torch.randint(0, 3, (batch,), generator=g)


def _close(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        for b in range(want[name].shape[0]):
            torch.testing.assert_close(got[name][b], want[name][b], rtol=1e-9, atol=1e-12, msg=f"{name}[{b}]")


def _no_vmap(*args, **kwargs):
    raise AssertionError("the vmap path ran where the short path was expected")


@pytest.mark.parametrize("make", [lambda: ScaleShift(5), lambda: Gated(5)], ids=["scale-shift", "parent-param"])
def test_elementwise_layers_take_the_short_path_after_their_first_call_and_stay_exact(make, monkeypatch):
    model, loss = _model(make()), nn.CrossEntropyLoss()
    x, y = _data()
    _close(pv.per_sample_grads(model, loss, x, y, strategy="hooks"), ref_grads(model, loss, x, y))
    assert list(fallback._ELEMENTWISE[model[2]].values()) == [True]
    monkeypatch.setattr(fallback, "vmap", _no_vmap)
    x2, y2 = torch.randn_like(x), y.flip(0)  # other data, same signature
    _close(pv.per_sample_grads(model, loss, x2, y2, strategy="hooks"), ref_grads(model, loss, x2, y2))


@pytest.mark.parametrize("make", [lambda: ScaleShift(5), lambda: Gated(5)], ids=["scale-shift", "parent-param"])
def test_jacobians_take_the_short_path_too(make, monkeypatch):
    model = _model(make())
    x, _ = _data(4)
    _close(pv.per_sample_jacobian(model, x, strategy="hooks"), ref_jacobian(model, x))
    monkeypatch.setattr(fallback, "vmap", _no_vmap)
    x2 = torch.randn_like(x)
    _close(pv.per_sample_jacobian(model, x2, strategy="hooks"), ref_jacobian(model, x2))


def test_a_layer_whose_copies_would_mix_samples_keeps_the_vmap_path():
    layer = FlipScale(5)
    model, loss = _model(layer), nn.CrossEntropyLoss()
    for seed in range(3):
        x, y = _data(5 + seed % 2)
        _close(pv.per_sample_grads(model, loss, x, y, strategy="hooks"), ref_grads(model, loss, x, y))
    assert set(fallback._ELEMENTWISE[layer].values()) == {False}


def test_one_sample_decides_nothing(monkeypatch):
    """A first call with B = 1 cannot show samples mixing: no verdict, and B = 1 calls stay on the vmap path."""
    layer = ScaleShift(5)
    model, loss = _model(layer), nn.CrossEntropyLoss()
    x, y = _data(1)
    _close(pv.per_sample_grads(model, loss, x, y, strategy="hooks"), ref_grads(model, loss, x, y))
    assert not fallback._ELEMENTWISE.get(layer)


class PositionCode(nn.Module):
    """A code made from the sequence length alone and repeated for every sample (XCiT's positional encoding): its
    call holds no samples in its inputs (two ints), only in its output."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 6, dtype=DT)

    def forward(self, batch: int, length: int):
        grid = torch.linspace(-1, 1, length * 4, dtype=DT).view(1, length, 4)
        return torch.tanh(self.proj(grid)).repeat(batch, 1, 1)


class Coded(nn.Module):
    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(5, 6, dtype=DT)
        self.code = PositionCode()
        self.head = nn.Linear(6, 2, dtype=DT)

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x) + self.code(x.shape[0], x.shape[1])).mean(1))


def test_a_layer_whose_inputs_hold_no_samples_gives_each_sample_its_own_rows_gradient(monkeypatch):
    torch.manual_seed(4)
    model, x, y = Coded(), torch.randn(3, 7, 5, dtype=DT), torch.randn(3, 2, dtype=DT)
    loss = nn.MSELoss(reduction="sum")
    masked, calls = fallback._masked, []
    monkeypatch.setattr(fallback, "_masked", lambda *a: calls.append(1) or masked(*a))
    _close(pv.per_sample_grads(model, loss, x, y, strategy="hooks", verify=False), ref_grads(model, loss, x, y))
    _close(pv.per_sample_jacobian(model, x, strategy="hooks", verify=False), ref_jacobian(model, x))
    want = ref_grads(model, loss, x, y)
    c = (1.0 / (torch.cat([g.reshape(3, -1) for g in want.values()], 1).norm(dim=1) + 1e-6)).clamp(max=1.0)
    got = pv.clipped_grad_sum(model, loss, x, y, 1.0, strategy="hooks", verify=False)  # book-keeping, this layer's rows
    for name, w in want.items():
        torch.testing.assert_close(got[name], torch.einsum("b,b...->...", c, w), rtol=1e-9, atol=1e-12)
    # the code's layer took the masked form: gradients, Jacobians (and their once-per-plan trial of the fallback's
    # nested vmap, engine.cotangents: 2 samples together, then each alone), the clipped sum
    assert len(calls) == 6


def test_a_replay_that_fails_names_the_tensors_the_layer_keeps():
    """Found by a probe: RecurrentGemma's layer keeps the batch's recurrent_states (4, 32) in an attribute, and the
    refusal named only a cache object and use_cache=False, which was already set."""
    from pergrad_viz.errors import HandOverError
    from pergrad_viz.rules.fallback import _replayed

    layer = torch.nn.Linear(5, 5)
    layer.recurrent_states = torch.zeros(4, 32)

    def replay():
        raise RuntimeError("The expanded size of the tensor (1) must match the existing size (4)")

    with pytest.raises(HandOverError, match=r"keeps in an attribute: self.recurrent_states \(4, 32\)"):
        _replayed(layer, replay)
