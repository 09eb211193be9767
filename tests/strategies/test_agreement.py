"""Every strategy (and "auto") agrees with the per-sample definition, a loop written here, on many models."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_dict_close, flatten_ref, ref_grads, ref_jacobian, trainable
from torch import nn
from zoo.nets import CASES, ScaleByScale, build_net

import pergrad_viz as pv
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.strategies import REGISTRY, hooks
from pergrad_viz.strategies.torch_func import VmapError
from pergrad_viz.tutorial import networks as models

ALL = (*pv.STRATEGIES, "auto")
# vmap falls back to a slow path for a few ops (Bilinear, kl_div, sparse): a warning, not a failure
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")),
]
RTOL, ATOL = 1e-10, 1e-12  # float64


def params(quantity: str):
    """(quantity, name, strategy) triples; vmap(jacrev) of a PReLU hits a PyTorch batching-rule bug
    (prelu's backward under nested vmap: "The size of tensor a (B) must match ..."), so torch_func cannot give
    PReLU Jacobians (auto picks hooks, which has a PReLU rule)."""
    prelu_bug = pytest.mark.xfail(raises=VmapError, strict=True,
                                  reason="PyTorch: vmap(jacrev(F.prelu)) with B > 1 fails in prelu's batching rule")
    out = []
    for name in CASES:
        for strategy in ALL:
            marks = prelu_bug if (quantity, name) == ("jacobian", "prelu") and strategy == "torch_func" else ()
            out.append(pytest.param(quantity, name, strategy, marks=marks, id=f"{quantity}-{name}-{strategy}"))
    return out


GRID = params("grads") + params("jacobian")


def build(name: str, dtype=torch.float64, device="cpu"):
    """zoo.nets.build_net(name), moved to ``dtype`` and ``device``."""
    model, x, y, loss, b_j = build_net(name)
    model = model.to(dtype=dtype, device=device)
    x = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
    y = y.to(device=device, dtype=dtype if y.is_floating_point() else y.dtype)
    return model, x, y, loss, b_j


@functools.cache
def reference(name: str, quantity: str, dtype=torch.float64, device="cpu"):
    model, x, y, loss, b_j = build(name, dtype, device)
    return ref_grads(model, loss, x, y) if quantity == "grads" else ref_jacobian(model, x[:b_j])


def compute(quantity, model, x, y, loss, b_j, **kw):
    if quantity == "grads":
        return pv.per_sample_grads(model, loss, x, y, **kw)
    return pv.per_sample_jacobian(model, x[:b_j], **kw)


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize(("quantity", "name", "strategy"), GRID)
def test_dict_agrees_with_reference_loop(quantity, name, strategy):
    model, x, y, loss, b_j = build(name)
    got = compute(quantity, model, x, y, loss, b_j, strategy=strategy)
    want = reference(name, quantity)
    assert list(want) == [n for n, _ in trainable(model)]
    assert_dict_close(got, want, RTOL, ATOL)


@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize("name", CASES)
def test_reference_is_not_degenerate(name, quantity):
    """Every parameter that the output depends on gets gradients well above the tolerances (a test model
    whose gradients vanish would let any strategy pass)."""
    for param, g in reference(name, quantity).items():
        if name == "unused" and param.split(".")[0] in ("unused", "dead"):
            assert torch.count_nonzero(g) == 0
        else:
            assert g.abs().max() > 1e-4, f"{name}: {param} has (near) zero gradients {g.abs().max():.2e}"


@pytest.mark.parametrize(("quantity", "name", "strategy"), GRID)
def test_flat_chunked_agrees_with_reference_loop(quantity, name, strategy):
    """flat=True is torch.cat of the flattened dict values in named_parameters order; chunks of 2 (last short)."""
    model, x, y, loss, b_j = build(name)
    got = compute(quantity, model, x, y, loss, b_j, strategy=strategy, flat=True, chunk_size=2)
    want = flatten_ref(reference(name, quantity), 1 if quantity == "grads" else 2)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
@pytest.mark.parametrize(("flat", "chunk_size"), [(True, None), (False, 2), (False, 1), (True, 100)])
def test_flat_and_chunk_combinations(quantity, strategy, flat, chunk_size):
    model, x, y, loss, b_j = build("shared")
    got = compute(quantity, model, x, y, loss, b_j, strategy=strategy, flat=flat, chunk_size=chunk_size)
    want = reference("shared", quantity)
    if flat:
        torch.testing.assert_close(got, flatten_ref(want, 1 if quantity == "grads" else 2), rtol=RTOL, atol=ATOL)
    else:
        assert_dict_close(got, want, RTOL, ATOL)


def test_unused_layer_gives_zeros_and_frozen_are_left_out():
    model, x, y, loss, _ = build("unused")
    for strategy in ALL:
        g = pv.per_sample_grads(model, loss, x, y, strategy=strategy)
        for name in ("unused.weight", "unused.bias", "dead.weight", "dead.bias"):
            assert torch.count_nonzero(g[name]) == 0, (strategy, name)
        j = pv.per_sample_jacobian(model, x, strategy=strategy)
        assert torch.count_nonzero(j["unused.weight"]) == 0 and torch.count_nonzero(j["dead.bias"]) == 0
        assert torch.count_nonzero(g["fc.weight"]) > 0
    model, x, y, loss, _ = build("frozen")
    g = pv.per_sample_grads(model, loss, x, y)
    assert list(g) == ["b.bias", "c.weight", "c.bias"]


# ------------------------------------------------------------------------------------------------ losses


def _loss_case(loss_name: str):
    torch.manual_seed(1)
    model = models.MLP(6, 5, 4).double()
    x = torch.randn(5, 6, dtype=torch.float64)
    classes = torch.tensor([0, 3, 1, 1, 2])
    if loss_name.startswith("mse"):
        return model, x, torch.randn(5, 4, dtype=torch.float64), nn.MSELoss(reduction=loss_name.split("-")[1])
    if loss_name == "lambda":
        return model, x, torch.randn(5, 4, dtype=torch.float64), lambda o, t: (o - t).pow(2).sum() + o.abs().mean()
    if loss_name == "lambda-not-vmappable":  # .item() cannot be vmapped: falls back to a loop
        return model, x, classes, lambda o, t: F.cross_entropy(o, t) * (2.0 if o.sum().item() > 0 else 1.0)
    weight = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    loss = {
        "ce-mean": nn.CrossEntropyLoss(),
        "ce-sum": nn.CrossEntropyLoss(reduction="sum"),
        "ce-weight-mean": nn.CrossEntropyLoss(weight=weight),
        "ce-weight-sum": nn.CrossEntropyLoss(weight=weight, reduction="sum"),
        "ce-label-smoothing": nn.CrossEntropyLoss(label_smoothing=0.2),
        "ce-label-smoothing-weight-sum": nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1, reduction="sum"),
    }[loss_name]
    return model, x, classes, loss


LOSSES = ["ce-mean", "ce-sum", "ce-weight-mean", "ce-weight-sum", "ce-label-smoothing",
          "ce-label-smoothing-weight-sum", "mse-mean", "mse-sum", "lambda", "lambda-not-vmappable"]
LOSS_GRID = [
    pytest.param(loss_name, strategy, id=f"{loss_name}-{strategy}", marks=pytest.mark.xfail(
        raises=VmapError, strict=True, reason="torch_func runs the loss under vmap: .item() cannot be vmapped"))
    if (loss_name, strategy) == ("lambda-not-vmappable", "torch_func") else
    pytest.param(loss_name, strategy, id=f"{loss_name}-{strategy}")
    for loss_name in LOSSES for strategy in ALL
]


@pytest.mark.parametrize(("loss_name", "strategy"), LOSS_GRID)
def test_losses_agree_with_reference_loop(loss_name, strategy):
    model, x, y, loss = _loss_case(loss_name)
    got = pv.per_sample_grads(model, loss, x, y, strategy=strategy, chunk_size=3)
    assert_dict_close(got, ref_grads(model, loss, x, y), RTOL, ATOL)


# ----------------------------------------------------------------------------------- float32 and devices


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
def test_float32_mlp(quantity, strategy, device):
    model, x, y, loss, b_j = build("mlp", torch.float32, device)
    got = compute(quantity, model, x, y, loss, b_j, strategy=strategy)
    want = reference("mlp", quantity, torch.float32, device)
    assert all(t.device.type == device for t in got.values())
    assert_dict_close(got, want, rtol=1e-4, atol=1e-6)
    # and close to the float64 definition
    want64 = reference("mlp", quantity)
    for n in want64:
        torch.testing.assert_close(got[n].double().cpu(), want64[n], rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("name", ["small-cnn", "embedding", "conv-2d-same-dil-groups-reflect", "shared",
                                  "relu-inplace", "batchnorm-eval", "unsupported"])
def test_devices(name, strategy, device):
    model, x, y, loss, b_j = build(name, torch.float64, device)
    got = pv.per_sample_grads(model, loss, x, y, strategy=strategy, flat=True, chunk_size=2)
    assert got.device.type == device
    want = reference(name, "grads", torch.float64, "cpu")
    torch.testing.assert_close(got.cpu(), flatten_ref(want, 1), rtol=1e-9, atol=1e-11)
    got_j = pv.per_sample_jacobian(model, x[:b_j], strategy=strategy)
    assert_dict_close({n: t.cpu() for n, t in got_j.items()}, reference(name, "jacobian"), 1e-9, 1e-11)


# ------------------------------------------------------------------------------------------- auto / hooks


AUTO_EXPECTED = [("mlp", "hooks"), ("small-cnn", "hooks"), ("embedding", "hooks"), ("layernorm", "hooks"),
                 ("batchnorm-eval", "hooks"), ("frozen", "hooks"), ("unsupported", "hooks"),
                 ("prelu", "hooks")]


@pytest.mark.parametrize(("quantity", "name", "expected"), [
    pytest.param(q, n, e, id=f"{q}-{n}", marks=[p.marks for p in GRID if p.id == f"{q}-{n}-auto"][0])
    for q in ("grads", "jacobian") for n, e in AUTO_EXPECTED])
def test_auto_resolves_and_dispatches(quantity, name, expected, monkeypatch):
    model, x, y, loss, b_j = build(name)
    assert pv.resolve_strategy("auto", Trainable.of(model)) == expected
    called = []
    for s, strategy in REGISTRY.items():
        original = getattr(strategy, quantity)

        def spy(*args, _s=s, _orig=original):
            called.append(_s)
            return _orig(*args)

        monkeypatch.setitem(REGISTRY, s, dataclasses.replace(strategy, **{quantity: spy}))
    got = compute(quantity, model, x, y, loss, b_j)
    assert set(called) == {expected}
    assert_dict_close(got, reference(name, quantity), RTOL, ATOL)


def test_a_custom_parameterised_module_goes_through_the_per_layer_fallback():
    model = nn.Sequential(nn.Linear(4, 5), ScaleByScale(5), nn.Linear(5, 2)).double()
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 1, 0])
    assert pv.resolve_strategy("auto", model, x) == "hooks"
    assert hooks.describe(Trainable.of(model), x) == {"0": "rule", "1": "fallback", "2": "rule"}
    loss = nn.CrossEntropyLoss()
    assert_dict_close(pv.per_sample_grads(model, loss, x, y, strategy="hooks"), ref_grads(model, loss, x, y),
                      RTOL, ATOL)
    model[1].requires_grad_(False)  # frozen: nothing for hooks to compute there
    assert hooks.describe(Trainable.of(model), x) == {"0": "rule", "2": "rule"}
    assert_dict_close(pv.per_sample_grads(model, loss, x, y, strategy="hooks"), ref_grads(model, loss, x, y),
                      RTOL, ATOL)


def test_subclass_overriding_forward_has_no_rule():
    class DoubledLinear(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(DoubledLinear(3, 2)).double()
    x, y = torch.randn(3, 3, dtype=torch.float64), torch.tensor([0, 1, 1])
    assert hooks.describe(Trainable.of(model), x) == {"0": "fallback"}
    loss = nn.CrossEntropyLoss()
    assert_dict_close(pv.per_sample_grads(model, loss, x, y), ref_grads(model, loss, x, y), RTOL, ATOL)


# ---------------------------------------------------------------------------------------------------- out=


@pytest.mark.parametrize("strategy", ALL)
@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
def test_out_is_written_in_place_and_returned(quantity, strategy):
    model, x, y, loss, b_j = build("embedding")
    want = flatten_ref(reference("embedding", quantity), 1 if quantity == "grads" else 2)
    out = torch.full(want.shape, float("nan"), dtype=torch.float64)
    ptr = out.data_ptr()
    got = compute(quantity, model, x, y, loss, b_j, strategy=strategy, flat=True, out=out, chunk_size=2)
    assert got is out and out.data_ptr() == ptr
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("strategy", ALL)
def test_out_non_contiguous_buffer(strategy):
    model, x, y, loss, _ = build("shared")
    want = flatten_ref(reference("shared", "grads"), 1)
    out = torch.zeros(want.shape[1], want.shape[0], dtype=torch.float64).t()  # (B, P), column-major
    got = pv.per_sample_grads(model, loss, x, y, strategy=strategy, flat=True, out=out)
    assert got is out
    torch.testing.assert_close(out, want, rtol=RTOL, atol=ATOL)


def test_out_errors():
    model, x, y, loss, _ = build("mlp")
    b, p = x.shape[0], sum(t.numel() for t in model.parameters())
    with pytest.raises(ValueError, match=r"out= is a flat buffer: pass flat=True"):
        pv.per_sample_grads(model, loss, x, y, out=torch.empty(b, p, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"out= does not fit the result: shape \(5, 10\) instead of \(5, "
                                         rf"{p}\)\. Allocate it with torch\.empty\(\(5, {p}\)"):
        pv.per_sample_grads(model, loss, x, y, flat=True, out=torch.empty(5, 10, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"dtype torch\.float32 instead of torch\.float64"):
        pv.per_sample_grads(model, loss, x, y, flat=True, out=torch.empty(b, p))
    with pytest.raises(ValueError, match=rf"shape \(3, 9, {p}\) instead of \(3, 10, {p}\)"):
        pv.per_sample_jacobian(model, x[:3], flat=True, out=torch.empty(3, 9, p, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"out= is a flat buffer"):
        pv.per_sample_jacobian(model, x[:3], out=torch.empty(3, 10, p, dtype=torch.float64))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available")
def test_out_on_the_wrong_device():
    model, x, y, loss, _ = build("mlp", device="cuda")
    b, p = x.shape[0], sum(t.numel() for t in model.parameters())
    with pytest.raises(ValueError, match=r"device cpu instead of cuda:0"):
        pv.per_sample_grads(model, loss, x, y, flat=True, out=torch.empty(b, p, dtype=torch.float64))


# ------------------------------------------------------------------------------------- more embeddings


class SparseEmbeddingNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4, sparse=True)
        self.head = nn.Linear(4, 3)

    def forward(self, idx):
        return self.head(torch.tanh(self.emb(idx))).mean(1)


@pytest.mark.parametrize("strategy", [
    pytest.param(s, marks=pytest.mark.xfail(raises=VmapError, strict=True,
                                            reason="sparse gradients under vmap: aten::view has no SparseCPU kernel"))
    if s == "torch_func" else s for s in ALL])
def test_sparse_embedding(strategy):
    torch.manual_seed(0)
    model = SparseEmbeddingNet().double()
    x, y = torch.tensor([[1, 2, 1], [3, 3, 0], [5, 4, 2]]), torch.tensor([0, 2, 1])
    loss = nn.CrossEntropyLoss()
    want = {n: t.to_dense() for n, t in ref_grads(model, loss, x, y).items()}
    assert_dict_close(pv.per_sample_grads(model, loss, x, y, strategy=strategy), want, RTOL, ATOL)


def assert_both_agree_with_the_loop(model, loss, x, y, strategy):
    """Per-sample gradients and Jacobians from ``strategy`` equal the tests' own loops."""
    assert_dict_close(pv.per_sample_grads(model, loss, x, y, strategy=strategy), ref_grads(model, loss, x, y),
                      RTOL, ATOL)
    assert_dict_close(pv.per_sample_jacobian(model, x, strategy=strategy), ref_jacobian(model, x), RTOL, ATOL)


class FunctionalTiedNet(nn.Module):
    """The embedding matrix is used again outside its module's forward: F.linear(h, self.emb.weight)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)

    def forward(self, idx):
        return F.linear(torch.tanh(self.mid(self.emb(idx))), self.emb.weight).mean(1)


@pytest.mark.parametrize("strategy", ALL)
def test_parameter_used_outside_its_module(strategy):
    torch.manual_seed(0)
    model = FunctionalTiedNet().double()
    x, y = torch.tensor([[1, 2, 1], [3, 3, 0], [5, 4, 2]]), torch.tensor([0, 2, 5])
    loss = nn.CrossEntropyLoss()
    if strategy == "hooks":  # it would miss the use in F.linear: refused, with the way out named
        refusal = r"parameter 'emb.weight' .* outside .*strategy='torch_func'"
        with pytest.raises(pv.UnsupportedModelError, match=refusal):
            pv.per_sample_grads(model, loss, x, y, strategy=strategy)
        with pytest.raises(pv.UnsupportedModelError, match="emb.weight"):
            pv.per_sample_jacobian(model, x, strategy=strategy)
        return
    if strategy == "auto":
        assert pv.resolve_strategy("auto", model, x) == "torch_func"
    assert_both_agree_with_the_loop(model, loss, x, y, strategy)


class KeywordCallNet(nn.Module):
    """Layers called with keyword arguments: self.fc(input=x)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(input=torch.tanh(self.fc(input=x)))


@pytest.mark.parametrize("strategy", ALL)
def test_layers_called_with_keyword_arguments(strategy):
    torch.manual_seed(0)
    model, x, y = KeywordCallNet().double(), torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 2, 1, 1])
    loss = nn.CrossEntropyLoss()
    assert_both_agree_with_the_loop(model, loss, x, y, strategy)


class TimeFirstNet(nn.Module):
    """A Linear applied to (T, B, in): its first dimension is not the batch (here T == B, so shapes match)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # (B, T, 4)
        return self.fc(x.transpose(0, 1)).mean(0)


@pytest.mark.parametrize("strategy", ALL)
def test_layer_without_the_batch_first(strategy):
    """T == B: a check of the first dimension alone would take T for the batch. The probe runs two batch sizes and
    finds the samples along dimension 1 of the layer's input; a Linear acts alike on every position, so its rule
    takes them moved to the front."""
    torch.manual_seed(0)
    model, x, y = TimeFirstNet().double(), torch.randn(3, 3, 4, dtype=torch.float64), torch.tensor([0, 1, 2])
    loss = nn.CrossEntropyLoss()
    if strategy == "auto":
        assert pv.resolve_strategy("auto", model, x) == "hooks"
        assert hooks.describe(Trainable.of(model), x) == {"fc": "rule"}
    assert_both_agree_with_the_loop(model, loss, x, y, strategy)
