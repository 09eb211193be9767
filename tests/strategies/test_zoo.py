"""The model zoo (tests/zoo/) against the reference loops: every strategy gives exactly the loop's numbers
or refuses with ``pv.UnsupportedModelError``, never a silent wrong answer; ``"auto"`` always gives the loop's
numbers; ``resolve_strategy`` says what the case expects; the model is left as it was after every call."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import assert_no_hooks, assert_state_unchanged, ref_grads, ref_jacobian, snapshot, trainable
from zoo.broadcast import CASES as BROADCAST
from zoo.cases import CASES as ARCHITECTURES
from zoo.cases import Case
from zoo.forwards import CASES as FORWARDS

import pergrad_viz as pv

ALL = (*pv.STRATEGIES, "auto")
BASELINES = ("loop", "autograd_stack", "batched_grad")  # slow: skipped on the expensive cases
MUST_SUCCEED = ("auto", "loop")  # the definition, and what the user gets by default
RTOL, ATOL = 1e-6, 1e-9
CASES = ARCHITECTURES + FORWARDS + BROADCAST
# Cases with nothing for the per-call check to catch: where auto resolves to hooks, an explicit hooks must succeed (a
# wrong rule would otherwise pass as a refusal, the per-call check turning it into an error and auto into torch_func).
# The forwards written to fool the probe (zoo/forwards.py) are the per-call check's to catch: a refusal is right there.
STRICT = {case.name for case in ARCHITECTURES + BROADCAST}

pytestmark = [
    # vmap falls back to a slow path for a few ops (Bilinear, RNNs): a warning, not a failure
    pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning"),
    # the (B, 1) vs (B,) MSELoss case broadcasts on purpose
    pytest.mark.filterwarnings("ignore:Using a target size:UserWarning"),
]


def _grid(quantity: str) -> list:
    out = []
    for case in CASES:
        if quantity == "jacobian" and not case.jacobian:
            continue
        for strategy in ALL:
            if case.expensive and strategy in BASELINES:
                continue
            out.append(pytest.param(case, strategy, id=f"{case.name}-{strategy}"))
    return out


@functools.cache
def _reference(name: str, quantity: str, loss_name: str | None, batch: int, k: int = 0) -> dict[str, torch.Tensor]:
    """The loop's result on a fresh model in its state for call k, computed once per (case, quantity, loss, batch,
    k)."""
    case = next(c for c in CASES if c.name == name)
    model = case.prepare(case.make_model(), k)
    x, y = case.make_inputs(batch)
    if quantity == "jacobian":
        return ref_jacobian(model, x)
    return ref_grads(model, case.loss_fns[loss_name](), x, y)


def _model_with_a_grad(case: Case):
    """The case's model, with a known .grad on its first trainable parameter (it must stay untouched)."""
    model = case.make_model()
    _, p = trainable(model)[0]
    p.grad = torch.full_like(p, 0.25)
    return model


def _runs(case: Case, quantity: str):
    """(label, batch, loss name, k) for every call a test makes, in the case's batch order (call k of each loss)."""
    losses = [None] if quantity == "jacobian" else list(case.loss_fns)
    return [(f"{case.name} B={b} call {k}" + (f" loss={ln}" if ln else ""), b, ln, k)
            for ln in losses for k, b in enumerate(case.batches)]


def _call(quantity: str, case: Case, model, loss_name: str | None, x, y, strategy: str):
    if quantity == "jacobian":
        return pv.per_sample_jacobian(model, x, strategy=strategy)
    return pv.per_sample_grads(model, case.loss_fns[loss_name](), x, y, strategy=strategy)


def _assert_refusal_is_explained(err: pv.UnsupportedModelError, case: Case, strategy: str, label: str) -> None:
    msg = str(err)
    assert len(msg) >= 40, f"{label} {strategy}: a refusal needs a message that says why, got {msg!r}"
    if case.expect != "refuse":  # the model is fine for some strategy: the message must name one
        assert any(s in msg for s in ("torch_func", "'auto'", "'loop'")), (
            f"{label} {strategy}: the refusal does not say which strategy to use instead: {msg!r}")


def _check(quantity: str, case: Case, strategy: str) -> None:
    model = _model_with_a_grad(case)
    for label, batch, loss_name, k in _runs(case, quantity):
        x, y = case.make_inputs(batch)
        case.prepare(model, k)
        before = snapshot(model)
        try:
            got = _call(quantity, case, model, loss_name, x, y, strategy)
        except pv.UnsupportedModelError as err:
            assert_no_hooks(model)
            assert_state_unchanged(model, before)
            if case.expect == "refuse":
                _assert_refusal_is_explained(err, case, strategy, label)
                continue
            assert strategy not in MUST_SUCCEED, f"{label}: strategy {strategy!r} must not refuse: {err}"
            assert not (strategy == "hooks" and case.name in STRICT and case.expects(k) == "hooks"), (
                f"{label}: auto resolves to hooks here, so hooks must not refuse: {err}")
            _assert_refusal_is_explained(err, case, strategy, label)
            continue
        assert_no_hooks(model)
        assert_state_unchanged(model, before)
        assert case.expect != "refuse", f"{label}: {strategy!r} should have raised UnsupportedModelError"
        want = _reference(case.name, quantity, loss_name, batch, k)
        assert isinstance(got, dict) and list(got) == list(want), f"{label}: keys {list(got)} vs {list(want)}"
        for name, w in want.items():
            g = got[name]
            assert g.shape == w.shape and g.dtype == w.dtype, f"{label} {name}: {g.shape}/{g.dtype} vs {w.shape}"
            torch.testing.assert_close(
                g, w, rtol=RTOL, atol=ATOL,
                msg=lambda m, name=name, label=label: f"{label} {strategy}: silently wrong {quantity} for {name}: {m}")


# ------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("case", "strategy"), _grid("grads"))
def test_grads_equal_loop_or_refuse(case, strategy):
    _check("grads", case, strategy)


@pytest.mark.parametrize(("case", "strategy"), _grid("jacobian"))
def test_jacobian_equals_loop_or_refuse(case, strategy):
    _check("jacobian", case, strategy)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_auto_resolves_as_expected(case):
    """On one model instance, in the case's batch order (a batch of 1 first must not decide for later ones)."""
    model = _model_with_a_grad(case)
    for k, b in enumerate(case.batches):
        x, _ = case.make_inputs(b)
        case.prepare(model, k)
        before = snapshot(model)
        if case.expect == "refuse":
            with pytest.raises(pv.UnsupportedModelError):
                pv.resolve_strategy("auto", model, x)
        else:
            got = pv.resolve_strategy("auto", model, x)
            # with one sample every layer sees "a batch of one" first: either answer is right there
            allowed = {"hooks", "torch_func"} if b == 1 else {case.expects(k)}
            assert got in allowed, f"{case.name} B={b}: auto resolved to {got!r}, expected {case.expects(k)!r}"
        assert_no_hooks(model)
        assert_state_unchanged(model, before)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
@pytest.mark.parametrize("case", [c for c in CASES if c.expect != "refuse"], ids=lambda c: c.name)
def test_grad_norms_equal_norms_of_loop(case, strategy):
    model = _model_with_a_grad(case)
    for label, batch, loss_name, k in _runs(case, "grads"):
        x, y = case.make_inputs(batch)
        case.prepare(model, k)
        before = snapshot(model)
        try:
            got = pv.per_sample_grad_norms(model, case.loss_fns[loss_name](), x, y, strategy=strategy)
        except pv.UnsupportedModelError as err:
            assert strategy != "auto", f"{label}: auto must not refuse: {err}"
            assert_state_unchanged(model, before)
            _assert_refusal_is_explained(err, case, strategy, label)
            continue
        assert_no_hooks(model)
        assert_state_unchanged(model, before)
        ref = _reference(case.name, "grads", loss_name, batch, k)
        want = torch.stack([t.reshape(batch, -1).pow(2).sum(1) for t in ref.values()]).sum(0).sqrt()
        torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, label=label: f"{label} {strategy}: silently wrong norms: {m}")


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_reference_is_not_degenerate(case):
    """Every trainable parameter gets gradients well above the tolerances in some call (else any strategy would
    pass; a head a multi-task model does not use in one call gets zeros there, rightly)."""
    if case.expect == "refuse":
        pytest.skip("no reference for a refused model")
    largest: dict[str, float] = {}
    for _, batch, loss_name, k in _runs(case, "grads"):
        for name, g in _reference(case.name, "grads", loss_name, batch, k).items():
            largest[name] = max(largest.get(name, 0.0), float(g.abs().max()))
    small = [name for name, m in largest.items() if m <= 1e-4]
    assert not small, f"{case.name}: {small} have (near) zero gradients in every call"


def test_batch_centering_really_mixes_samples():
    """The batched forward of that case differs from the per-sample one, so a batched strategy that does not
    notice gives wrong numbers (the test above would not catch a case that is not adversarial)."""
    case = next(c for c in CASES if c.name == "batch-centering")
    model = case.make_model()
    x, _ = case.make_inputs(case.batches[-1])
    with torch.no_grad():
        alone = torch.cat([model(x[i:i + 1]) for i in range(x.shape[0])])
        assert (model(x) - alone).abs().max() > 1e-3


@pytest.mark.parametrize("case", [c for c in CASES if c.jacobian and c.expect != "refuse"], ids=lambda c: c.name)
def test_empirical_ntk_equals_jacobian_products(case):
    """K[i, j] = J_i J_j^T from the loop's Jacobians; the NTK works from the same layer rules and fallbacks."""
    k = len(case.batches) - 1
    model = case.prepare(_model_with_a_grad(case), k)
    batch = case.batches[k]
    x, _ = case.make_inputs(batch)
    before = snapshot(model)
    got = pv.empirical_ntk(model, x, mode="full")
    assert_no_hooks(model)
    assert_state_unchanged(model, before)
    jac = _reference(case.name, "jacobian", None, batch, k)
    flat = torch.cat([t.reshape(batch, t.shape[1], -1) for t in jac.values()], dim=-1)  # (B, Y, P)
    want = torch.einsum("iyp,jzp->ijyz", flat, flat)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{case.name}: silently wrong empirical NTK: {m}")
