"""Odd but valid models (issue 28, tests/zoo/odd.py): the loop's numbers from auto and the loop, and from every other
strategy or a clear UnsupportedModelError naming one that works; complex outputs refused naming
output=torch.view_as_real (which then works), empty outputs give empty Jacobians, a lazy module a clear error."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refuses, assert_state_unchanged, flatten_ref, ref_grads, ref_jacobian, snapshot
from torch import nn
from zoo.odd import CASES, complex_model, empty_model, lazy_model

import pergrad_viz as pv

ALL = (*pv.STRATEGIES, "auto")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _xy(batch=3):
    g = torch.Generator().manual_seed(8)
    return torch.randn(batch, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (batch,), generator=g)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize(("name", "make", "context"), CASES, ids=[c[0] for c in CASES])
def test_odd_models_give_the_loops_numbers_or_refuse_clearly(name, make, context, strategy, quantity, flat):
    model, (x, y) = make(), _xy()
    loss = torch.nn.CrossEntropyLoss()
    want = ref_grads(model, loss, x, y) if quantity == "grads" else ref_jacobian(model, x)
    before = snapshot(model)
    try:
        with context():
            got = (pv.per_sample_grads(model, loss, x, y, strategy=strategy, flat=flat) if quantity == "grads"
                   else pv.per_sample_jacobian(model, x, strategy=strategy, flat=flat))
    except pv.UnsupportedModelError as e:
        assert strategy not in ("auto", "loop"), f"{name}: {strategy} must not refuse: {e}"
        assert any(s in str(e) for s in ("'auto'", "'loop'", "torch_func")), str(e)
        assert_state_unchanged(model, before)
        return
    assert_state_unchanged(model, before)
    lead = 1 if quantity == "grads" else 2
    torch.testing.assert_close(got if flat else flatten_ref(got, lead), flatten_ref(want, lead))


@pytest.mark.parametrize("strategy", ALL)
def test_complex_outputs_are_refused_naming_view_as_real_which_works(strategy):
    model, (x, _) = complex_model(), _xy()
    assert_refuses(lambda: pv.per_sample_jacobian(model, x, strategy=strategy), model, "torch.view_as_real",
                   error=TypeError)
    try:
        got = pv.per_sample_jacobian(model, x, strategy=strategy, flat=True, output=torch.view_as_real)
    except pv.UnsupportedModelError as e:
        assert strategy not in ("auto", "loop"), str(e)
        return
    want = ref_jacobian(torch.nn.Sequential(model, _ViewAsReal()), x)
    torch.testing.assert_close(got, flatten_ref({k.removeprefix("0."): v for k, v in want.items()}, 2))


class _ViewAsReal(torch.nn.Module):
    def forward(self, z):
        return torch.view_as_real(z)


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("strategy", ALL)
def test_empty_outputs_give_empty_jacobians(strategy, flat):
    model, (x, _) = empty_model(), _xy()
    got = pv.per_sample_jacobian(model, x, strategy=strategy, flat=flat)
    p = sum(q.numel() for q in model.parameters())
    if flat:
        assert got.shape == (3, 0, p)
    else:
        assert {n: tuple(t.shape) for n, t in got.items()} == {"fc.weight": (3, 0, 3, 4), "fc.bias": (3, 0, 3)}


@pytest.mark.parametrize("strategy", ALL)
def test_a_lazy_module_not_initialised_names_the_fix(strategy):
    model, (x, y) = lazy_model(), _xy()
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="not initialised yet .* run one forward pass first"):
        pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, strategy=strategy)
    assert torch.equal(torch.get_rng_state(), rng) and torch.is_grad_enabled()
    assert isinstance(model[0].weight, torch.nn.parameter.UninitializedParameter)  # nothing ran
    with torch.no_grad():
        model(x[:1])
    got = pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, strategy=strategy, flat=True)
    torch.testing.assert_close(got, flatten_ref(ref_grads(model, torch.nn.CrossEntropyLoss(), x, y), 1))


@pytest.mark.parametrize("mode", ["full", "trace"])
def test_empty_outputs_give_an_empty_kernel(mode):
    """Found by a probe: the NTK of a (B, 0) output raised a raw IndexError from autograd's batched grad."""
    model, (x, _) = empty_model(), _xy()
    kernel = pv.empirical_ntk(model, x, x[:2], mode=mode)
    assert kernel.shape == ((3, 2, 0, 0) if mode == "full" else (3, 2)) and not kernel.any()


class _Argmax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x).argmax(1)


def test_an_integer_output_names_a_floating_tensor_to_differentiate():
    model, (x, _) = _Argmax().double(), _xy()
    with pytest.raises(TypeError, match="has no gradient.*output=") as info:
        pv.per_sample_jacobian(model, x)
    assert "view_as_real" not in str(info.value)


def test_torch_funcs_batching_rule_notes_are_not_shown():
    """Found by a probe: torch_func on an LSTM printed PyTorch's 'There is a performance drop ... Please file us an
    issue' warnings to the caller (the explorer's learner saw them); the rows are the loop's."""
    import warnings

    torch.manual_seed(0)

    class Last(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm, self.head = torch.nn.LSTM(3, 4, batch_first=True), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.lstm(x)[0][:, -1])

    model, x, y = Last(), torch.randn(3, 5, 3), torch.tensor([0, 1, 0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, strategy="torch_func")
    assert not [w for w in caught if "performance drop" in str(w.message)]
    for i in range(3):
        want = torch.autograd.grad(torch.nn.CrossEntropyLoss()(model(x[i:i + 1]), y[i:i + 1]), model.head.weight)[0]
        torch.testing.assert_close(got["head.weight"][i], want)


@pytest.mark.parametrize("call", ["jacobian", "ntk", "batched_grad", "hooks_jacobian"])
def test_anomaly_mode_shows_no_error_for_a_call_that_succeeds(call):
    """Found by a probe: under set_detect_anomaly(True) the batched backward's attempt (anomaly mode has no batching
    rule) failed and was caught, but anomaly mode had already warned 'Error detected in ViewBackward0' with a
    traceback into the package, for a call whose result was right."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    runs = {"jacobian": lambda: pv.per_sample_jacobian(model, x, flat=True),
            "hooks_jacobian": lambda: pv.per_sample_jacobian(model, x, flat=True, strategy="hooks"),
            "ntk": lambda: pv.empirical_ntk(model, x, mode="trace"),
            "batched_grad": lambda: pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, flat=True,
                                                        strategy="batched_grad")}
    with warnings.catch_warnings(record=True) as caught, torch.autograd.set_detect_anomaly(True):
        warnings.simplefilter("always")
        got = runs[call]()
    assert not [str(w.message)[:80] for w in caught if "Error detected" in str(w.message)]
    if call == "batched_grad":
        want = pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y, flat=True, strategy="loop")
    else:
        jacobian = pv.per_sample_jacobian(model, x, flat=True, strategy="loop")
        want = jacobian if call != "ntk" else torch.einsum("iyp,jyp->ij", jacobian, jacobian)
    torch.testing.assert_close(got, want)


class _Ragged(nn.Module):
    """Three outputs where the batch it runs in holds a large value, else two (``cut``: outputs kept)."""

    def __init__(self, cut: int = 2):
        super().__init__()
        self.a, self.cut = nn.Linear(3, 4), cut

    def forward(self, x):
        return self.a(x)[:, : self.cut + int(x.abs().max() > 2)]


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("call", ["jacobian", "ntk"])
def test_outputs_whose_size_depends_on_the_data_are_refused(call, first):
    """Found by a probe: Y was read from sample 0 alone, and rows of samples with fewer outputs were returned
    unwritten (uninitialised memory), a sample with more was a raw IndexError, and sample 0 without outputs gave an
    NTK of zeros."""
    model = _Ragged().double()
    x = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)).clamp(-1.5, 1.5)
    x[0 if first else 3, 0] = 3.0
    run = {"jacobian": lambda m: pv.per_sample_jacobian(m, x), "ntk": lambda m: pv.empirical_ntk(m, x)}[call]
    with pytest.raises(pv.UndefinedPerSampleError, match=r"gives \d output elements but .* gives \d: the forward's "
                                                         "output size depends on the data"):
        run(model)
    if not first:
        with pytest.raises(pv.UndefinedPerSampleError, match="sample (3 )?alone gives 1 output elements but sample 0 "
                                                             "alone gives 0"):
            run(_Ragged(cut=0).double())
        for strategy in ("hooks", "autograd_stack", "batched_grad", "loop"):
            for verify in (True, False):
                with pytest.raises(pv.UndefinedPerSampleError, match="gives 3 output elements but sample 0 alone"):
                    pv.per_sample_jacobian(model, x, strategy=strategy, verify=verify)


class _PositionsToo(nn.Embedding):
    """ProphetNet's positional embedding: takes a shape, returns (embeddings, the integer positions)."""

    def forward(self, shape):
        positions = torch.arange(shape[1]).expand(shape[0], shape[1])
        return super().forward(positions), positions


class _WithPositions(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos, self.head = nn.Embedding(50, 8), _PositionsToo(16, 8), nn.Linear(8, 3)

    def forward(self, ids):
        p, _ = self.pos(ids.shape)
        return self.head((self.tok(ids) + p).mean(1))


@pytest.mark.parametrize("call", ["hooks", "auto", "norms", "clipped_sum"])
def test_a_layer_returning_integers_beside_its_output_takes_the_fallback(call):
    """Found by a probe: ProphetNet's positional embedding returns its integer positions too, and the per-layer
    fallback handed vjp an integer cotangent (a raw error from hooks, auto, the norms and the clipped sum)."""
    torch.manual_seed(0)
    model, loss_fn = _WithPositions().double(), nn.CrossEntropyLoss()
    ids, y = torch.randint(0, 50, (4, 6)), torch.tensor([0, 2, 1, 1])
    want = flatten_ref(ref_grads(model, loss_fn, ids, y), 1)
    if call == "norms":
        torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, ids, y), want.norm(dim=1))
    elif call == "clipped_sum":
        got = pv.clipped_grad_sum(model, loss_fn, ids, y, 0.05)
        c = (0.05 / (want.norm(dim=1) + 1e-6)).clamp(max=1)
        torch.testing.assert_close(torch.cat([g.reshape(-1) for g in got.values()]), (c[:, None] * want).sum(0))
    else:
        torch.testing.assert_close(pv.per_sample_grads(model, loss_fn, ids, y, strategy=call, flat=True), want)
