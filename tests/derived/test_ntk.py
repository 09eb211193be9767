"""pv.empirical_ntk: equal to J J^T from the per-sample Jacobians of the plain double loop in tests/helpers.py
(ref_jacobian, independent of pergrad_viz), on models the layer rules cover (without materialising) and on models
that force the fallbacks."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_no_hooks,
    assert_state_unchanged,
    flatten_ref,
    ref_jacobian,
    snapshot,
)
from torch import nn
from zoo.nets import DoublyTiedNet, FlatRows, ScaleByWeight, SharedLinearAndNormNet, TokenNet

import pergrad_viz as pv
from pergrad_viz import api
from pergrad_viz.core.batch import Batch
from pergrad_viz.derived import ntk
from pergrad_viz.tutorial.networks import MLP, SmallCNN

TOL = {"rtol": 1e-10, "atol": 1e-12}


class Branchy(nn.Module):
    """Inputs whose first feature is above 100 go through an extra layer: x1 and x2 see different layers."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if bool((x[:, 0] > 100).all()):
            h = torch.tanh(self.extra(h))
        return self.head(h)


class ScaledLogits(nn.Module):
    """A learnable 0-dim temperature multiplying the outputs, as CLIP's ``logit_scale``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.logit_scale.exp()


def case(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """(model in float64, x1 (5, ...), x2 (3, ...))."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if name == "mlp":
        return MLP(12, 10, 3).double(), randn(5, 12), randn(3, 12)
    if name == "cnn":
        return SmallCNN(3).double(), randn(5, 1, 28, 28), randn(3, 1, 28, 28)
    if name == "tokens":
        x1 = torch.tensor([[1, 2, 2, 0, 0, 3, 1], [0, 0, 0, 0, 0, 0, 0], [5, 5, 5, 5, 4, 0, 11],
                           [7, 7, 7, 7, 7, 7, 7], [11, 10, 9, 8, 6, 4, 3]])
        return TokenNet().double(), x1, torch.tensor([[2, 2, 1, 0, 0, 0, 7], [3, 4, 5, 6, 7, 8, 9], [1] * 7])
    if name == "tied":
        tokens = torch.randint(0, 6, (8, 7), generator=g)
        return DoublyTiedNet(vocab=6).double(), tokens[:5], tokens[5:]
    if name == "shared":
        return SharedLinearAndNormNet().double(), randn(5, 6), randn(3, 6)
    if name == "flat_rows":
        return FlatRows().double(), randn(5, 2, 4), randn(3, 2, 4)
    if name == "fallback":
        model = nn.Sequential(nn.Linear(5, 4), ScaleByWeight(4), nn.Tanh(), nn.Linear(4, 3)).double()
        return model, randn(5, 5), randn(3, 5)
    if name == "scalar":
        return ScaledLogits().double(), randn(5, 4), randn(3, 4)
    raise AssertionError(name)


def reference(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None, mode: str) -> torch.Tensor:
    """J1 J2^T from the (N, Y, P) Jacobians of helpers.ref_jacobian (a plain double loop of autograd.grad)."""
    j1 = flatten_ref(ref_jacobian(model, x1), 2)
    j2 = j1 if x2 is None else flatten_ref(ref_jacobian(model, x2), 2)
    return torch.einsum("iyp,jzp->ijyz" if mode == "full" else "iyp,jyp->ij", j1, j2)


def refuse_jacobian(*args, **kwargs):
    raise AssertionError("per_sample_jacobian was called: the (N, Y, P) Jacobians were materialised")


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("use_x2", [False, True], ids=["x2_none", "x2_given"])
@pytest.mark.parametrize("mode", ntk.MODES)
@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens", "shared", "tied", "scalar"])
def test_ntk_equals_jacobian_products(name, mode, use_x2, chunk_size, monkeypatch):
    model, x1, x2 = case(name)
    x2 = x2 if use_x2 else None
    want = reference(model, x1, x2, mode)
    monkeypatch.setattr(api, "per_sample_jacobian", refuse_jacobian)
    got = pv.empirical_ntk(model, x1, x2, mode=mode, chunk_size=chunk_size)
    n2, y = 3 if use_x2 else 5, 6 if name == "tied" else 3
    assert got.shape == ((5, n2, y, y) if mode == "full" else (5, n2)) and got.dtype == torch.float64
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("use_x2", [False, True], ids=["x2_none", "x2_given"])
@pytest.mark.parametrize("mode", ntk.MODES)
@pytest.mark.parametrize("name", ["fallback", "flat_rows"])
def test_fallback_model(name, mode, use_x2, chunk_size, monkeypatch):
    model, x1, x2 = case(name)
    x2 = x2 if use_x2 else None
    want = reference(model, x1, x2, mode)
    calls = []
    real = api.per_sample_jacobian

    def spy(model_, inputs, **kw):
        calls.append((inputs.size if isinstance(inputs, Batch) else inputs.shape[0], kw["strategy"]))
        return real(model_, inputs, **kw)

    monkeypatch.setattr(api, "per_sample_jacobian", spy)
    torch.testing.assert_close(pv.empirical_ntk(model, x1, x2, mode=mode, chunk_size=chunk_size), want, **TOL)
    if name == "fallback":  # a layer without a rule: the per-layer fallback, no whole-model Jacobians
        assert calls == []
    else:  # a layer on (N*T, ...) rows: the Jacobians of each sample alone
        assert calls == ([(5, "torch_func"), (3, "torch_func")] if use_x2 else [(5, "torch_func")])


@pytest.mark.parametrize("mode", ntk.MODES)
@pytest.mark.parametrize("gram", [True, False])
def test_linear_and_embedding_both_branches(gram, mode, monkeypatch):
    model, x1, x2 = case("tokens")
    want = reference(model, x1, x2, mode)
    kinds = []
    monkeypatch.setattr(ntk, "gram_is_cheaper", lambda kind, *a: kinds.append(kind) or gram)
    torch.testing.assert_close(pv.empirical_ntk(model, x1, x2, mode=mode), want, **TOL)
    assert {"linear", "embedding"} <= set(kinds)


def test_mixed_branches_between_x1_and_x2(monkeypatch):
    # x1's chunks keep Gram pieces, x2's the layers' Jacobians: the kernel converts as needed.
    model, x1, x2 = case("tokens")
    want = reference(model, x1, x2, "full")
    seen = []
    monkeypatch.setattr(ntk, "gram_is_cheaper", lambda *a: seen.append(1) or len(seen) <= 3)
    torch.testing.assert_close(pv.empirical_ntk(model, x1, x2), want, **TOL)


@pytest.mark.parametrize("mode", ntk.MODES)
def test_layer_reached_by_one_input_set_only(mode):
    torch.manual_seed(0)
    model = Branchy().double()
    x1 = torch.randn(4, 4, dtype=torch.float64)
    x1[:, 0] += 200  # x1 goes through `extra`, x2 does not
    x2 = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(pv.empirical_ntk(model, x1, x2, mode=mode), reference(model, x1, x2, mode), **TOL)


def test_branch_choice_by_cost():
    lin, emb = nn.Linear(6, 5), nn.Embedding(1000, 64)
    assert ntk.gram_is_cheaper("linear", lin, 1, 10, True)  # (N, in) inputs: always the Gram form
    assert not ntk.gram_is_cheaper("linear", lin, 50, 3, True)  # many tokens, a small layer
    assert ntk.gram_is_cheaper("embedding", emb, 8, 3, True)


@pytest.mark.parametrize("name", ["mlp", "cnn", "fallback"])
@pytest.mark.parametrize("mode", ntk.MODES)
def test_symmetric_when_x2_is_none(name, mode):
    model, x1, _ = case(name)
    k = pv.empirical_ntk(model, x1, mode=mode, chunk_size=2)
    kt = k.transpose(0, 1)
    assert torch.equal(k, kt.transpose(2, 3) if mode == "full" else kt)
    diag = torch.diagonal(k.reshape(5, 5, -1)[:, :, ::4] if mode == "full" else k).reshape(-1)
    assert (diag > 0).all()  # J J^T has a positive diagonal (||J_i[y]||^2)


def test_trace_is_the_trace_of_full():
    model, x1, x2 = case("cnn")
    full = pv.empirical_ntk(model, x1, x2)
    torch.testing.assert_close(pv.empirical_ntk(model, x1, x2, mode="trace"),
                               torch.diagonal(full, dim1=2, dim2=3).sum(-1), **TOL)


def test_frozen_parameters_are_left_out():
    model, x1, x2 = case("mlp")
    model.fc1.weight.requires_grad_(False)
    want = reference(model, x1, x2, "full")
    torch.testing.assert_close(pv.empirical_ntk(model, x1, x2), want, **TOL)
    model.fc1.weight.requires_grad_(True)
    assert not torch.allclose(pv.empirical_ntk(model, x1, x2), want)


def test_invalid_arguments_name_the_fix():
    model, x1, x2 = case("mlp")
    with pytest.raises(ValueError, match="unknown mode 'diag'.*'full'.*'trace'"):
        pv.empirical_ntk(model, x1, mode="diag")
    with pytest.raises(ValueError, match=r"same kind.*pass x2 with shape \(N2, 12\)"):
        pv.empirical_ntk(model, x1, x2[:, :6])
    with pytest.raises(ValueError, match="cast one of them"):
        pv.empirical_ntk(model, x1, x2.float())
    with pytest.raises(ValueError, match="empty batch"):
        pv.empirical_ntk(model, x1, x2[:0])
    with pytest.raises(TypeError, match="inputs must be a torch.Tensor"):
        pv.empirical_ntk(model, x1, x2.tolist())
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        pv.empirical_ntk(model, x1, chunk_size=-1)
    tok, t1, _ = case("tokens")
    with pytest.raises(ValueError, match="same kind"):
        pv.empirical_ntk(tok, t1, t1.int())


@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens", "fallback"])
def test_model_left_as_found_after_success_and_failure(name):
    model, x1, x2 = case(name)
    model.train()
    next(m for m in model.modules() if m is not model).eval()
    first = next(model.parameters())
    first.grad = torch.full_like(first, 3.0)
    before = snapshot(model)
    pv.empirical_ntk(model, x1, x2)
    pv.empirical_ntk(model, x1, mode="trace", chunk_size=2)
    assert_state_unchanged(model, before)
    assert_no_hooks(model)
    bad = x1 + 100 if name == "tokens" else torch.cat([x1, x1], dim=1)  # the forward pass fails
    with pytest.raises((RuntimeError, IndexError)):
        pv.empirical_ntk(model, bad)
    assert_state_unchanged(model, before)
    assert_no_hooks(model)


def test_kernel_over_the_memory_budget_is_refused_before_computing():
    model = MLP(784, 8, 10)
    with pytest.raises(pv.MemoryBudgetError, match=r"empirical NTK of 6 x 6 samples x 10\^2 outputs.*KiB"):
        pv.empirical_ntk(model, torch.randn(6, 784), mode="full", max_bytes=1000)


def test_the_features_of_every_chunk_count_and_a_chunk_bounds_them(monkeypatch):
    """Found by a probe: the budget counted K alone while every chunk's features were kept (a (B, T, V) output's
    took 6 GB past max_bytes=50 MB). Now they count; where they would not fit, two chunks' at a time (each x2 chunk
    computed again for every x1 chunk), the same K; and where even that does not fit, refused naming chunk_size."""
    torch.manual_seed(0)
    model = MLP(784, 8, 10)
    x, x2 = torch.randn(6, 784), torch.randn(4, 784)  # one sample's features: about 3.8 KiB
    with pytest.raises(pv.MemoryBudgetError, match="pass chunk_size=2 or less"):
        pv.empirical_ntk(model, x, mode="trace", max_bytes=20_000)
    passes = []
    features = ntk._features
    monkeypatch.setattr(ntk, "_features", lambda *args: passes.append(args[1].size) or features(*args))
    bounded = pv.empirical_ntk(model, x, mode="trace", max_bytes=20_000, chunk_size=1, verify=False)
    assert len(passes) == 6 * 7 // 2  # the upper triangle's pairs, a chunk's own once
    monkeypatch.setattr(ntk, "_features", features)
    torch.testing.assert_close(bounded, pv.empirical_ntk(model, x, mode="trace", verify=False))
    passes.clear()
    monkeypatch.setattr(ntk, "_features", lambda *args: passes.append(args[1].size) or features(*args))
    both = pv.empirical_ntk(model, x, x2, max_bytes=30_000, chunk_size=2, verify=False)
    assert passes == [2, 2, 2] * 3  # each x1 chunk, then x2's two chunks again for it
    torch.testing.assert_close(both, reference(model, x, x2, "full"), rtol=1e-4, atol=1e-5)


class _DictOutput(nn.Module):
    """Returns a dict, as a Hugging Face model returns a ModelOutput: the NTK needs to be told which tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return {"logits": self.b(h), "hidden": h}


class _DictOutputReusingAWeight(_DictOutput):
    """The same, ``a``'s weight used again outside ``a``: ``auto`` computes each sample alone, not by hooks."""

    def forward(self, x):
        h = torch.tanh(self.a(x)) + nn.functional.linear(x, self.a.weight)
        return {"logits": self.b(h), "hidden": h}


@pytest.mark.parametrize("mode", ["full", "trace"])
@pytest.mark.parametrize("net", [_DictOutput, _DictOutputReusingAWeight])
def test_ntk_of_a_model_returning_a_dict_takes_output(mode, net):
    model = net().double()
    x1, x2 = torch.randn(4, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    params = list(model.parameters())

    def jac(x):  # (Y, P) of one sample, by autograd
        out = model(x[None])["logits"].reshape(-1)
        return torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(out[j], params,
                                                                                 retain_graph=True)])
                            for j in range(out.numel())])

    j1, j2 = [jac(x) for x in x1], [jac(x) for x in x2]
    want = torch.stack([torch.stack([a @ b.T for b in j2]) for a in j1])  # (N1, N2, Y, Y)
    if mode == "trace":
        want = want.diagonal(dim1=2, dim2=3).sum(-1)
    got = pv.empirical_ntk(model, x1, x2, mode=mode, output=lambda out: out["logits"])
    torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match=r"output=lambda out: out\['logits'\]"):
        pv.empirical_ntk(model, x1)


def test_a_check_failed_under_one_output_selector_does_not_refuse_later_calls():
    """Found by a probe: empirical_ntk with output=lambda o: o.t() (Y == B, so (B, Y) in shape, not in meaning) failed
    hooks' check, auto handed over (a right kernel), and the plan kept 'the samples interact': every later hooks call
    on the model, gradients too, was refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 4)).double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 2, 3])
    kernel = pv.empirical_ntk(model, x, output=lambda o: o.t(), mode="trace")
    params = list(model.parameters())  # sample i alone: its output (1, 4) as (4, 1), its 4 outputs' gradients
    jac = [torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(x[i:i + 1]).t()[k, 0], params)])
                        for k in range(4)]) for i in range(4)]
    want = torch.stack([torch.stack([(jac[i] * jac[j]).sum() for j in range(4)]) for i in range(4)])
    torch.testing.assert_close(kernel, want)
    grads = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    for i in range(4):
        g = torch.autograd.grad(nn.CrossEntropyLoss()(model(x[i:i + 1]), y[i:i + 1]), model[0].weight)[0]
        torch.testing.assert_close(grads["0.weight"][i], g)
