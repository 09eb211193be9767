"""pv.per_sample_grad_norms: equal, per sample, to the norms of the per-sample gradients of the plain loop in
tests/helpers.py (ref_grads, independent of pergrad_viz), for every layer type the rules cover (ghost norms, Gram
matrices, per-layer fallbacks), for models they do not cover, and for every strategy in chunks."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    assert_no_hooks,
    assert_state_unchanged,
    flatten_ref,
    ref_grads,
    snapshot,
)
from torch import nn
from zoo.nets import DoublyTiedNet, FlatRows, ScaleByWeight, SharedLinearAndNormNet, TokenNet

import pergrad_viz as pv
from pergrad_viz import api
from pergrad_viz.core.batch import Batch
from pergrad_viz.rules import linear as linear_rules
from pergrad_viz.tutorial.networks import MLP, SmallCNN, bias_free_net

TOL = {"rtol": 1e-10, "atol": 1e-12}


# Models ----------------------------------------------------------------------------------------------


class SeqNet(nn.Module):
    """A Linear on (B, T, in), then mean over T and a head."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)
        self.head = nn.Linear(d_out, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(x)).mean(1))


class LayerNormNet(nn.Module):
    """LayerNorm on (B, T, D) and on (B, H), between Linears."""

    def __init__(self):
        super().__init__()
        self.ln_in = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 8)
        self.ln = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(self.ln_in(x))).mean(1)
        return self.head(self.ln(h))


class SharedEmbedding(nn.Module):
    """One Embedding called on two slices of the tokens."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(9, 4, padding_idx=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(x[:, :4]).mean(1) * self.emb(x[:, 4:]).sum(1)))


class Conv1dBatchNorm(nn.Module):
    """Conv1d -> BatchNorm1d in eval mode (running statistics) -> Linear."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, kernel_size=3, padding=1, stride=2)
        self.bn = nn.BatchNorm1d(4)
        self.head = nn.Linear(4, 3)
        with torch.no_grad():
            self.bn.running_mean.uniform_(-0.5, 0.5)
            self.bn.running_var.uniform_(0.5, 2.0)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.bn(self.conv(x))).mean(-1))


def tokens() -> torch.Tensor:
    """(5, 7) indices with repeated tokens and padding (0), one sample all padding."""
    return torch.tensor([[1, 2, 2, 0, 0, 3, 1], [0, 0, 0, 0, 0, 0, 0], [5, 5, 5, 5, 4, 0, 11],
                         [7, 7, 7, 7, 7, 7, 7], [11, 10, 9, 8, 6, 4, 3]])


def frozen_mlp() -> nn.Module:
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 4), nn.Tanh(), nn.Linear(4, 3))
    model[0].weight.requires_grad_(False)  # frozen weight, trainable bias
    model[2].bias.requires_grad_(False)
    return model


class Unused(nn.Module):
    """A trainable layer that the forward pass never calls: its per-sample gradients are zero."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.spare = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class BatchCentred(nn.Module):
    """Adds its hidden layer's batch mean: the samples of a batch interact, so ``auto`` leaves the hooks path and
    computes each sample alone (torch_func); alone, a sample's mean is itself."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        return self.head(h + h.mean(0, keepdim=True))


class ScaledLogits(nn.Module):
    """A learnable 0-dim temperature multiplying the logits, as CLIP's ``logit_scale``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.logit_scale = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.logit_scale.exp()


def case(name: str) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """(model in float64, loss_fn, inputs, targets) for a named case; B = 5."""
    g = torch.Generator().manual_seed(0)
    ce, mse = nn.CrossEntropyLoss(), nn.MSELoss(reduction="sum")
    classes = torch.tensor([0, 2, 1, 2, 0])
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(12, 10, 4).double(), ce, torch.randn(5, 12, generator=g, dtype=torch.float64), classes % 4
    if name == "bias_free":
        return bias_free_net().double(), ce, torch.randn(5, 2, generator=g, dtype=torch.float64), classes % 2
    if name == "cnn":
        return SmallCNN(3).double(), ce, torch.randn(5, 1, 28, 28, generator=g, dtype=torch.float64), classes
    if name == "conv1d_bn":
        return Conv1dBatchNorm().double(), ce, torch.randn(5, 2, 9, generator=g, dtype=torch.float64), classes
    if name == "inplace_relu":  # the hooks capture copies when a layer's output is changed in place
        model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)).double()
        return model, ce, torch.randn(5, 6, generator=g, dtype=torch.float64), classes
    if name == "tokens":
        return TokenNet().double(), ce, tokens(), classes
    if name == "tied":
        return DoublyTiedNet(vocab=10).double(), ce, torch.randint(0, 10, (5, 6), generator=g), classes
    if name == "layer_norm":
        return LayerNormNet().double(), mse, torch.randn(5, 4, 6, generator=g, dtype=torch.float64), \
            torch.randn(5, 3, generator=g, dtype=torch.float64)
    if name == "shared":
        return SharedLinearAndNormNet().double(), ce, torch.randn(5, 6, generator=g, dtype=torch.float64), classes
    if name == "shared_embedding":
        return SharedEmbedding().double(), ce, torch.randint(0, 9, (5, 7), generator=g), classes
    if name == "frozen":
        return frozen_mlp().double(), ce, torch.randn(5, 5, generator=g, dtype=torch.float64), classes
    if name == "unused":
        return Unused().double(), ce, torch.randn(5, 5, generator=g, dtype=torch.float64), classes
    if name == "unsupported":
        model = nn.Sequential(nn.Linear(5, 4), ScaleByWeight(4), nn.Tanh(), nn.Linear(4, 3)).double()
        return model, ce, torch.randn(5, 5, generator=g, dtype=torch.float64), classes
    if name == "flat_rows":
        return FlatRows().double(), mse, torch.randn(5, 3, 4, generator=g, dtype=torch.float64), \
            torch.randn(5, 3, generator=g, dtype=torch.float64)
    if name == "interacting":
        return BatchCentred().double(), ce, torch.randn(5, 5, generator=g, dtype=torch.float64), classes
    if name == "scalar":
        return ScaledLogits().double(), ce, torch.randn(5, 5, generator=g, dtype=torch.float64), classes
    raise AssertionError(name)


SUPPORTED = ["mlp", "bias_free", "cnn", "conv1d_bn", "inplace_relu", "tokens", "tied", "layer_norm",
             "shared", "shared_embedding", "frozen", "unused", "scalar"]
MATERIALISING = [s for s in pv.STRATEGIES if s != "hooks"]


def reference(model: nn.Module, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor):
    """(total (B,), {name: (B,)}) from the per-sample gradients of helpers.ref_grads (the definition, a plain loop)."""
    ref = ref_grads(model, loss_fn, x, y)
    per = {n: torch.linalg.norm(g.reshape(g.shape[0], -1), dim=1) for n, g in ref.items()}
    return torch.linalg.norm(flatten_ref(ref, 1), dim=1), per


def assert_norms(model, loss_fn, x, y, **kw) -> None:
    want_total, want_per = reference(model, loss_fn, x, y)
    total = pv.per_sample_grad_norms(model, loss_fn, x, y, **kw)
    per = pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True, **kw)
    assert total.shape == want_total.shape and total.dtype == torch.float64
    torch.testing.assert_close(total, want_total, **TOL)
    assert list(per) == list(want_per)
    for name, want in want_per.items():
        torch.testing.assert_close(per[name], want, **TOL, msg=lambda m, name=name: f"{name}: {m}")


# Values ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [None, 2])
@pytest.mark.parametrize("name", SUPPORTED)
def test_ghost_norms_equal_materialised_norms(name, chunk_size, monkeypatch):
    model, loss_fn, x, y = case(name)
    want_total, want_per = reference(model, loss_fn, x, y)
    assert want_total.min() >= 0 and want_total.max() > 0
    with monkeypatch.context() as m:
        m.setattr(api, "per_sample_grads", lambda *a, **k: pytest.fail("materialised on the ghost path"))
        total = pv.per_sample_grad_norms(model, loss_fn, x, y, chunk_size=chunk_size)
        per = pv.per_sample_grad_norms(model, loss_fn, x, y, chunk_size=chunk_size, per_parameter=True)
    torch.testing.assert_close(total, want_total, **TOL)
    assert list(per) == list(want_per)
    for n, want in want_per.items():
        torch.testing.assert_close(per[n], want, **TOL)
    torch.testing.assert_close(torch.stack(list(per.values())).square().sum(0), total.square(), **TOL)


def test_hooks_strategy_is_the_ghost_path():
    model, loss_fn, x, y = case("mlp")
    want, _ = reference(model, loss_fn, x, y)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, x, y, strategy="hooks"), want, **TOL)


def test_tied_parameters_add_up_across_layers():
    model, loss_fn, x, y = case("tied")
    per = pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True)
    assert list(per) == ["emb.weight", "fc1.weight", "fc1.bias", "out.bias"]  # named_parameters() order
    _total, want = reference(model, loss_fn, x, y)
    torch.testing.assert_close(per["emb.weight"], want["emb.weight"], **TOL)
    torch.testing.assert_close(per["fc1.weight"], want["fc1.weight"], **TOL)


def test_scale_grad_by_freq_is_refused():
    model, loss_fn, x, y = case("tokens")
    model.emb.scale_grad_by_freq = True
    with pytest.raises(pv.UnsupportedModelError, match="scale_grad_by_freq"):
        pv.per_sample_grad_norms(model, loss_fn, x, y)


def test_padding_rows_and_all_padding_sample():
    model, loss_fn, x, y = case("tokens")
    per = pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True)
    # Sample 1 is all padding: its embedding gradient is exactly zero, its head gradient is not.
    assert per["emb.weight"][1] == 0 and per["head.weight"][1] > 0
    assert (per["emb.weight"][[0, 2, 3, 4]] > 0).all()


@pytest.mark.parametrize("gram", [True, False])
@pytest.mark.parametrize("shape", [(3, 8, 8), (6, 3, 4)], ids=["T3_8x8", "T6_3x4"])
def test_linear_on_tokens_both_branches(shape, gram, monkeypatch):
    tokens_, d_in, d_out = shape
    # The natural choice: Gram matrices for T=3 and an 8x8 layer (3 * 16 <= 64), the layer's gradient for T=6, 3x4.
    assert linear_rules.gram_is_faster(tokens_, d_in, d_out) == (tokens_ == 3)
    taken = []
    monkeypatch.setattr(linear_rules, "gram_is_faster", lambda t, i, o: taken.append(t) or gram)
    model = SeqNet(d_in, d_out).double()
    x = torch.randn(5, tokens_, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert_norms(model, nn.CrossEntropyLoss(), x, torch.tensor([0, 1, 2, 1, 0]))
    assert tokens_ in taken  # the fc layer went through the forced branch


def test_shared_linear_uses_the_calls_cross_terms():
    # Calls of a shared layer add up before the norm: sum of the per-call norms would be wrong.
    model, loss_fn, x, y = case("shared")
    got = pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True)["fc.weight"]
    _total, want = reference(model, loss_fn, x, y)
    torch.testing.assert_close(got, want["fc.weight"], **TOL)


def test_frozen_parameters_are_left_out():
    model, loss_fn, x, y = case("frozen")
    per = pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True)
    assert list(per) == ["0.bias", "2.weight", "4.weight", "4.bias"]
    _total, want = reference(model, loss_fn, x, y)
    for n in per:
        torch.testing.assert_close(per[n], want[n], **TOL)


def test_unused_layer_has_zero_norm():
    model, loss_fn, x, y = case("unused")
    per = pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True)
    assert torch.equal(per["spare.weight"], torch.zeros(5, dtype=torch.float64))
    assert (per["fc.weight"] > 0).all()


@pytest.mark.parametrize("strategy", pv.STRATEGIES)
def test_every_strategy_gives_the_same_norms(strategy):
    model, loss_fn, x, y = case("cnn")
    want, _ = reference(model, loss_fn, x, y)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy), want, **TOL)


@pytest.mark.parametrize("name", ["mlp", "tokens", "tied", "unsupported", "scalar"])
@pytest.mark.parametrize("strategy", MATERIALISING)
def test_materialising_strategies_in_chunks(strategy, name):
    """B = 5 in chunks of 2 (the last one short): every chunk's rows are computed, per sample and per parameter."""
    model, loss_fn, x, y = case(name)
    assert_norms(model, loss_fn, x, y, strategy=strategy, chunk_size=2)


@pytest.mark.parametrize("chunk_size", [None, 2, 3])
@pytest.mark.parametrize("name", ["interacting", "flat_rows"])
def test_auto_off_the_fast_path_in_chunks(name, chunk_size, monkeypatch):
    """Models the hooks strategy cannot take (the samples interact; a layer on (B*T, ...) rows): ``auto``
    materialises each chunk's gradients, each sample alone, and every chunk counts."""
    model, loss_fn, x, y = case(name)
    sizes = []
    real = api.per_sample_grads

    def spy(model_, loss_fn_, inputs, targets, **kw):
        sizes.append(inputs.size if isinstance(inputs, Batch) else inputs.shape[0])
        return real(model_, loss_fn_, inputs, targets, **kw)

    monkeypatch.setattr(api, "per_sample_grads", spy)
    assert_norms(model, loss_fn, x, y, chunk_size=chunk_size)
    if chunk_size is not None:  # twice (total, then per parameter), chunk by chunk
        assert sizes == 2 * [min(chunk_size, 5 - s) for s in range(0, 5, chunk_size)]
    if name == "interacting":  # one batched forward pass would not be the per-sample definition
        with pytest.raises(pv.UnsupportedModelError, match="samples interact"):
            pv.per_sample_grad_norms(model, loss_fn, x, y, strategy="batched_grad")


def test_zero_dim_parameter():
    """A learnable scalar (CLIP's logit_scale): its per-sample gradient is (B,), its norm the absolute value."""
    model, loss_fn, x, y = case("scalar")
    ref = ref_grads(model, loss_fn, x, y)
    assert ref["logit_scale"].shape == (5,) and (ref["logit_scale"] != 0).all()
    for strategy in ["auto", *pv.STRATEGIES]:
        grads = pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        torch.testing.assert_close(grads["logit_scale"], ref["logit_scale"], **TOL)
        torch.testing.assert_close(pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy, flat=True),
                                   flatten_ref(ref, 1), **TOL)
        per = pv.per_sample_grad_norms(model, loss_fn, x, y, strategy=strategy, per_parameter=True, chunk_size=2)
        torch.testing.assert_close(per["logit_scale"], ref["logit_scale"].abs(), **TOL)


@pytest.mark.parametrize("chunk_size", [None, 2])
def test_layer_without_a_rule_uses_the_per_layer_fallback(chunk_size, monkeypatch):
    """A layer with no closed-form rule gets its own per-sample gradients from torch.func; the (B, P) gradients of
    the whole model are never materialised."""
    model, loss_fn, x, y = case("unsupported")
    want_total, want_per = reference(model, loss_fn, x, y)
    calls = []
    real = api.per_sample_grads

    def spy(model_, loss_fn_, inputs, targets, **kw):
        calls.append((inputs.shape[0], kw.get("strategy")))
        return real(model_, loss_fn_, inputs, targets, **kw)

    monkeypatch.setattr(api, "per_sample_grads", spy)
    total = pv.per_sample_grad_norms(model, loss_fn, x, y, chunk_size=chunk_size)
    per = pv.per_sample_grad_norms(model, loss_fn, x, y, chunk_size=chunk_size, per_parameter=True)
    torch.testing.assert_close(total, want_total, **TOL)
    for n, want in want_per.items():
        torch.testing.assert_close(per[n], want, **TOL)
    assert calls == []
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, x, y, strategy="hooks"), want_total, **TOL)


def test_layer_on_flattened_rows_falls_back_under_auto():
    model, loss_fn, x, y = case("flat_rows")
    want, _ = reference(model, loss_fn, x, y)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, x, y), want, **TOL)
    with pytest.raises(pv.UnsupportedModelError, match=r"layer 'fc' \(Linear\).*strategy='torch_func'"):
        pv.per_sample_grad_norms(model, loss_fn, x, y, strategy="hooks")


def test_float32_within_float32_tolerance():
    model = MLP(30, 20, 5)
    x = torch.randn(8, 30, generator=torch.Generator().manual_seed(3))
    y = torch.arange(8) % 5
    want, _ = reference(model, nn.CrossEntropyLoss(), x, y)
    got = pv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, y)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# Validation and the model-restoring_modes rule ------------------------------------------------------------------


def test_invalid_arguments_name_the_fix():
    model, loss_fn, x, y = case("mlp")
    with pytest.raises(ValueError, match="batch sizes differ"):
        pv.per_sample_grad_norms(model, loss_fn, x, y[:3])
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        pv.per_sample_grad_norms(model, loss_fn, x, y, strategy="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        pv.per_sample_grad_norms(model, loss_fn, x, y, chunk_size=0)
    with pytest.raises(ValueError, match="empty batch"):
        pv.per_sample_grad_norms(model, loss_fn, x[:0], y[:0])
    with pytest.raises(ValueError, match="cast one of them"):
        pv.per_sample_grad_norms(model, loss_fn, x.float(), y)
    with pytest.raises(TypeError, match="per_parameter must be True or False"):
        pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter="yes")
    with pytest.raises(pv.UnsupportedModelError, match="model.eval()"):
        pv.per_sample_grad_norms(nn.Sequential(nn.Linear(12, 4), nn.Dropout(0.5)).double(), loss_fn, x, y)


def prepared(name: str):
    model, loss_fn, x, y = case(name)
    model.train()
    first = next(m for m in model.modules() if m is not model)
    first.eval()  # a mix of modes, to see that each flag is restored
    for i, p in enumerate(model.parameters()):
        if i % 2 == 0 and p.requires_grad:
            p.grad = torch.full_like(p, 7.0)
    return model, loss_fn, x, y


class Boom(Exception):
    pass


def boom_loss(output, target):
    raise Boom("loss failed")


@pytest.mark.parametrize("name", ["mlp", "cnn", "tokens", "shared", "unsupported"])
def test_model_left_as_found_after_success_and_failure(name):
    model, loss_fn, x, y = prepared(name)
    before = snapshot(model)
    pv.per_sample_grad_norms(model, loss_fn, x, y)
    pv.per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True, chunk_size=2)
    assert_state_unchanged(model, before)
    assert_no_hooks(model)
    with pytest.raises(Boom):
        pv.per_sample_grad_norms(model, boom_loss, x, y)
    assert_state_unchanged(model, before)
    assert_no_hooks(model)
    bad = x + 100 if name == "tokens" else torch.cat([x, x], dim=1)  # a forward pass that fails
    with pytest.raises((RuntimeError, IndexError)):
        pv.per_sample_grad_norms(model, loss_fn, bad, y)
    assert_state_unchanged(model, before)
    assert_no_hooks(model)
