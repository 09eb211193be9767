"""A Jacobian's ``output=`` seen by the probe (pergrad_viz.engine.selection) and part of the plan's key: a selection
that mixes the samples is computed sample by sample (auto) or refused (a batched strategy), checked or not, whatever
calls came before; against the definition written here, one sample at a time."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

import pergrad_viz as pv

COUPLING = {"norm": lambda o: o / o.norm(), "centred": lambda o: o - o.mean(0)}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _loop(model, x, select):
    """(B, Y, P): each sample alone, its selected output's Jacobian."""
    params = list(model.parameters())
    rows = []
    for i in range(x.shape[0]):
        out = select(model(x[i:i + 1])).reshape(-1)
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[j], params,
                                                                                       retain_graph=True)])
                                 for j in range(out.numel())]))
    return torch.stack(rows)


X = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", list(COUPLING))
@pytest.mark.parametrize("warm", [False, True])
def test_a_selection_that_mixes_the_samples_is_computed_sample_by_sample(name, warm):
    """Found by a probe: output= was applied after the probe and left out of the plan's key, so without the check
    (verify=False), or after plain calls had made the check rare, the batched strategies gave the selection of the
    batch's output (rows 2.96 off; an NTK 60.8 off)."""
    model, select = _model(), COUPLING[name]
    if warm:
        for _ in range(3):
            pv.per_sample_jacobian(model, X)
    want = _loop(model, X, select)
    for verify in (False, True):
        got = pv.per_sample_jacobian(model, X, flat=True, output=select, verify=verify)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        kernel = pv.empirical_ntk(model, X, output=select, verify=verify, mode="trace")
        torch.testing.assert_close(kernel, torch.einsum("iyp,jyp->ij", want, want), rtol=1e-9, atol=1e-10)
    for strategy in ("hooks", "autograd_stack", "batched_grad"):
        with pytest.raises(pv.UnsupportedModelError, match="what output= selects from the model's output"):
            pv.per_sample_jacobian(model, X, output=select, strategy=strategy, verify=False)


def test_a_mixing_selection_leaves_later_calls_without_one_on_the_fast_path():
    """Found by a probe: one call with a mixing output= made every later call of the model refused by hooks."""
    model = _model()
    pv.per_sample_jacobian(model, X, output=COUPLING["centred"])
    got = pv.per_sample_jacobian(model, X, flat=True, strategy="hooks")
    torch.testing.assert_close(got, _loop(model, X, lambda o: o), rtol=1e-9, atol=1e-12)
    assert pv.resolve_strategy("auto", model, X) == "hooks"


def test_a_selection_that_puts_the_samples_last_is_not_batched():
    model = _model()
    want = _loop(model, X, lambda o: o.t())
    torch.testing.assert_close(pv.per_sample_jacobian(model, X, flat=True, output=lambda o: o.t(), verify=False),
                               want, rtol=1e-9, atol=1e-12)
    with pytest.raises(pv.UnsupportedModelError, match="not along dimension 0|output= selects"):
        pv.per_sample_jacobian(model, X, output=lambda o: o.t(), strategy="hooks", verify=False)


def test_a_selection_is_keyed_by_what_it_does_not_by_its_address():
    """Found by a review: output= was keyed by id() where it had no code (a functools.partial) or held a tensor: a
    freed per-sample partial's address reused by a mixing one gave it the per-sample plan (rows 2.4 off, no check),
    and a closure holding a fresh tensor each call was probed again on every call."""
    import functools
    import gc

    from pergrad_viz.engine import probe

    model = _model()
    for _ in range(3):  # freed at once: the next partial may get its address
        pv.per_sample_jacobian(model, X, output=functools.partial(torch.narrow, dim=1, start=0, length=2))
        gc.collect()
    mixing = functools.partial(torch.div, other=torch.tensor(2.0))
    want = _loop(model, X, lambda o: o / 2.0)
    torch.testing.assert_close(pv.per_sample_jacobian(model, X, flat=True, output=mixing, verify=False), want)
    centred = functools.partial(lambda o, k: o - o.mean(0) * k, k=1.0)
    with pytest.raises(pv.UnsupportedModelError, match="what output= selects"):
        pv.per_sample_jacobian(model, X, output=centred, strategy="hooks", verify=False)
    probes = []
    made = probe._make_plan
    try:
        probe._make_plan = lambda *a, **k: probes.append(1) or made(*a, **k)

        def fresh():
            index = torch.tensor([0, 2])
            return lambda o: o.index_select(1, index)

        for _ in range(5):
            pv.per_sample_jacobian(model, X, output=fresh())
    finally:
        probe._make_plan = made
    assert len(probes) <= 1


class _Picker:
    def __init__(self, normalise: bool):
        self.normalise = normalise

    def pick(self, o):
        return o / o.norm() if self.normalise else o

    __call__ = pick


NORMALISE = False  # a module global an output= reads


def _by_global(o):
    return o / o.norm() if NORMALISE else o


@dataclasses.dataclass(slots=True)
class _Slotted:
    normalise: bool

    def __call__(self, o):
        return o / o.norm() if self.normalise else o


def _numpy_switched(value):
    return lambda o: o / o.norm() if value else o


CONFIG = {"normalise": False}  # a module global dict an output= reads


def _by_config(o):
    return o / o.norm() if CONFIG["normalise"] else o


MAKERS = {"default argument": lambda flag: (lambda o, n=flag: o / o.norm() if n else o),
          "numpy value": lambda flag: _numpy_switched(np.float64(flag)),
          "slots dataclass": _Slotted,
          "bound method": lambda flag: _Picker(flag).pick,
          "callable object": _Picker,
          "dict in the closure": lambda flag: (lambda o, d={"n": flag}: o / o.norm() if d["n"] else o)}


@pytest.mark.parametrize("make", [*MAKERS, "module global", "global dict"])
def test_a_selection_switched_by_what_it_holds_gets_its_own_plan(make, monkeypatch):
    """Found by a probe: output= was keyed by its code and closure only, so one that mixes the samples by a default
    argument, a bound method's object, a callable's attribute, a dict or a module global reused the plan of its
    per-sample twin (verify=False: Jacobians 0.6 off)."""
    model = _model()
    if make == "module global":
        pv.per_sample_jacobian(model, X, output=_by_global, verify=False)
        monkeypatch.setattr(__import__(__name__), "NORMALISE", True)
        select = _by_global
    elif make == "global dict":
        pv.per_sample_jacobian(model, X, output=_by_config, verify=False)
        monkeypatch.setitem(CONFIG, "normalise", True)
        select = _by_config
    else:
        pv.per_sample_jacobian(model, X, output=MAKERS[make](False), verify=False)
        select = MAKERS[make](True)
    got = pv.per_sample_jacobian(model, X, flat=True, output=select, verify=False)
    torch.testing.assert_close(got, _loop(model, X, select), rtol=1e-9, atol=1e-12)


def test_a_selection_made_of_parameters_detached_or_not_callable_is_refused_naming_it():
    """Found by a probe: output=lambda o: model.head(o) (a layer of the model applied to its output) gave auto's and
    torch_func's Jacobians without that layer's part (0.74 off, verify=False); o.detach() a raw autograd error from
    auto, hooks and the NTK; output="logits" a raw 'str' object is not callable from the probe."""
    model = _model()
    head = model.head = nn.Linear(3, 3).double()  # trainable parameters of the model, used by output= alone
    for strategy in ("auto", "torch_func", "hooks"):
        with pytest.raises(ValueError, match="output= computes with trainable parameters itself"):
            pv.per_sample_jacobian(model, X, output=lambda o: head(o), strategy=strategy, verify=False)
        with pytest.raises(ValueError, match="no trainable parameter takes part in the model output"):
            pv.per_sample_jacobian(model, X, output=lambda o: o.detach(), strategy=strategy)
    with pytest.raises(ValueError, match="no trainable parameter takes part"):
        pv.empirical_ntk(model, X, output=lambda o: o.detach())
    with pytest.raises(TypeError, match="output= must be a function of what the model returns"):
        pv.per_sample_jacobian(model, X, output="logits")


def test_a_selection_with_a_parameter_of_its_own_is_no_use_of_the_models():
    """Found by a review: the refusal above took any selection that needs grad (a calibration temperature, an
    nn.Parameter outside the model) for one made of the model's parameters."""
    model, temperature = _model(), nn.Parameter(torch.tensor(2.0, dtype=torch.float64))
    got = pv.per_sample_jacobian(model, X, flat=True, output=lambda o: o / temperature)
    torch.testing.assert_close(got, _loop(model, X, lambda o: o / temperature), rtol=1e-9, atol=1e-12)


def test_odd_values_in_a_selection_are_keyed_without_error_or_a_new_plan_each_call():
    """Found by a review: a small sparse tensor in output='s closure raised from its key; one holding NaN never equalled
    its own key (a new probe on every call)."""
    from pergrad_viz.engine import probe

    model, table, nan = _model(), torch.eye(3, dtype=torch.float64).to_sparse(), torch.tensor([float("nan")])
    made, probes = probe._make_plan, []
    try:
        probe._make_plan = lambda *a, **k: probes.append(1) or made(*a, **k)
        for _ in range(3):
            got = pv.per_sample_jacobian(model, X, flat=True, output=lambda o: o @ table.to_dense() + 0 * nan.sum())
    finally:
        probe._make_plan = made
    assert len(probes) == 1
    torch.testing.assert_close(got, _loop(model, X, lambda o: o), rtol=1e-9, atol=1e-12)  # a NaN constant: no part
