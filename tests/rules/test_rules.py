"""Closed-form rules (pergrad_viz.rules) called directly, against torch.func per-sample gradients:
vmap(grad(...)) of sum(output * grad_output) over functional_call of the bare layer, each sample a batch of one,
in float64, for N = 1 and N = 3 output gradients per sample."""

from __future__ import annotations

import pytest
import torch
from helpers import empty_out
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.utils._pytree import tree_leaves

from pergrad_viz.rules import call_rule_for, rule_for
from pergrad_viz.rules.conv import conv, conv_transpose
from pergrad_viz.rules.normalization import instance_norm, layer_norm
from pergrad_viz.rules.recurrent import recurrent

TOL = {"rtol": 1e-10, "atol": 1e-12}
B = 3
DT = torch.float64


def reference(module: nn.Module, call, args: list, arg_dims: list, grads: list, grad_dims: list) -> dict:
    """{name: (N, B, *param.shape)}: per-sample gradients of sum(leaf * grad) over the output leaves of
    ``call(params, *args)``, one sample at a time (args[i] has its samples in dimension arg_dims[i], grads[i] is
    (N, *leaf.shape) with the samples in dimension grad_dims[i] + 1)."""
    params = {n: p.detach() for n, p in module.named_parameters() if p.requires_grad}

    def f(p, a, g):
        leaves = call(p, *[t.unsqueeze(d) for t, d in zip(a, arg_dims, strict=True)])
        return sum((leaf * gi.unsqueeze(d)).sum() for leaf, gi, d in zip(leaves, g, grad_dims, strict=True))

    per_sample = vmap(grad(f), in_dims=(None, list(arg_dims), list(grad_dims)))
    return vmap(per_sample, in_dims=(None, None, [0] * len(grads)))(params, list(args), list(grads))


def check_single(module: nn.Module, rule, x: torch.Tensor, n: int, **kwargs) -> None:
    """A single-tensor rule on input x (B, ...) against the reference, with N random output gradients."""
    assert rule_for(module) is rule
    y = module(x, **kwargs)
    g = torch.randn(n, *y.shape, dtype=DT)
    out = empty_out(module, n, B)
    rule(module, x, g, out)
    want = reference(module, lambda p, xb: [functional_call(module, p, (xb,), kwargs)], [x], [0], [g], [0])
    assert set(out) == set(want)
    for name in want:
        torch.testing.assert_close(out[name], want[name], **TOL, msg=name)


# ---------------------------------------------------------------------------------------------- convolutions

CONVS = {
    "conv1d same circular": (lambda: nn.Conv1d(3, 4, 3, padding="same", padding_mode="circular", dilation=2),
                             (3, 9)),
    "conv2d stride groups": (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, groups=2), (4, 7, 6)),
    "conv3d stride groups": (lambda: nn.Conv3d(4, 6, 3, stride=2, padding=1, groups=2), (4, 5, 6, 5)),
    "conv3d dilation no bias": (lambda: nn.Conv3d(4, 4, 2, stride=(2, 1, 3), padding=(1, 0, 2), dilation=2,
                                                  groups=4, bias=False), (4, 6, 5, 7)),
    "conv3d same reflect": (lambda: nn.Conv3d(3, 2, (2, 3, 2), dilation=(2, 1, 1), padding="same",
                                              padding_mode="reflect"), (3, 5, 4, 4)),
    "conv3d valid": (lambda: nn.Conv3d(2, 3, (1, 2, 3), padding="valid"), (2, 3, 4, 5)),
}

TRANSPOSED = {
    "1d stride output_padding": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1), (3, 6)),
    "1d dilation groups": (lambda: nn.ConvTranspose1d(4, 6, 2, stride=3, dilation=2, groups=2, output_padding=2),
                           (4, 5)),
    "2d mixed": (lambda: nn.ConvTranspose2d(4, 2, (3, 2), stride=(2, 1), padding=(1, 0), output_padding=(1, 0),
                                            dilation=(1, 2), groups=2), (4, 4, 5)),
    "2d output_padding < dilation": (lambda: nn.ConvTranspose2d(2, 3, 3, dilation=3, output_padding=2), (2, 3, 4)),
    "3d depthwise no bias": (lambda: nn.ConvTranspose3d(4, 4, 2, stride=2, padding=1, output_padding=1, groups=4,
                                                        bias=False), (4, 3, 4, 3)),
    "3d mixed": (lambda: nn.ConvTranspose3d(2, 3, (3, 2, 2), stride=(1, 2, 2), dilation=(2, 1, 1)), (2, 3, 3, 4)),
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", list(CONVS))
def test_conv(name, n):
    torch.manual_seed(0)
    make, shape = CONVS[name]
    check_single(make().to(DT), conv, torch.randn(B, *shape, dtype=DT), n)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", list(TRANSPOSED))
def test_conv_transpose(name, n):
    torch.manual_seed(0)
    make, shape = TRANSPOSED[name]
    check_single(make().to(DT), conv_transpose, torch.randn(B, *shape, dtype=DT), n)


def test_conv_transpose_output_size_and_frozen_weight():
    torch.manual_seed(0)
    layer = nn.ConvTranspose2d(2, 3, 3, stride=3, padding=1).to(DT)  # output_size picks output_padding (1, 2)
    check_single(layer, conv_transpose, torch.randn(B, 2, 3, 4, dtype=DT), 3, output_size=[8, 12])
    layer.weight.requires_grad_(False)
    check_single(layer, conv_transpose, torch.randn(B, 2, 3, 4, dtype=DT), 1)


def test_conv3d_frozen_bias():
    torch.manual_seed(0)
    layer = nn.Conv3d(2, 4, 2, groups=2).to(DT)
    layer.bias.requires_grad_(False)
    check_single(layer, conv, torch.randn(B, 2, 3, 3, 3, dtype=DT), 3)


# ------------------------------------------------------------------------------------------- instance norm

INSTANCE_NORMS = {
    "1d": (lambda: nn.InstanceNorm1d(3, affine=True), (3, 7), True),
    "2d running stats, training": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (3, 4, 5),
                                   True),
    "2d running stats, eval": (lambda: nn.InstanceNorm2d(3, affine=True, track_running_stats=True), (3, 4, 5),
                               False),
    "3d eval without running stats": (lambda: nn.InstanceNorm3d(2, affine=True), (2, 3, 4, 3), False),
    "3d running stats, eval": (lambda: nn.InstanceNorm3d(2, affine=True, track_running_stats=True), (2, 3, 4, 3),
                               False),
}


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", list(INSTANCE_NORMS))
def test_instance_norm(name, n):
    torch.manual_seed(0)
    make, shape, training = INSTANCE_NORMS[name]
    layer = make().to(DT).train(training)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
        if layer.track_running_stats:
            layer.running_mean.normal_()
            layer.running_var.uniform_(0.5, 2.0)
    x = torch.randn(B, *shape, dtype=DT) * 2 + 1
    g = torch.randn(n, B, *shape, dtype=DT)
    out = empty_out(layer, n, B)
    assert rule_for(layer) is instance_norm
    instance_norm(layer, x, g, out)

    def call(p, xb):  # per-sample copies of the buffers: the training forward updates them in place
        buffers = {k: v + 0 * xb.sum() for k, v in layer.named_buffers()}
        return [functional_call(layer, {**p, **buffers}, (xb,))]

    want = reference(layer, call, [x], [0], [g], [0])
    for k in want:
        torch.testing.assert_close(out[k], want[k], **TOL, msg=k)


# ---------------------------------------------------------------------------------------------- recurrent

# (module, hx given, which outputs get gradients (output, h_n[, c_n]), frozen parameters (names containing it))
RECURRENT = {
    "rnn tanh hx output": (lambda: nn.RNN(3, 4, batch_first=True), True, (1, 0), ""),
    "rnn relu 2 layers bidirectional": (lambda: nn.RNN(3, 4, 2, nonlinearity="relu", bidirectional=True), False,
                                        (1, 1), ""),
    "rnn no bias h_n": (lambda: nn.RNN(3, 4, 2, bias=False, batch_first=True), True, (0, 1), ""),
    "lstm output": (lambda: nn.LSTM(3, 4, batch_first=True), False, (1, 0, 0), ""),
    "lstm 2 layers bidirectional hx h_n": (lambda: nn.LSTM(3, 4, 2, bidirectional=True, batch_first=True), True,
                                           (0, 1, 0), ""),
    "lstm no bias c_n": (lambda: nn.LSTM(3, 4, 2, bias=False), True, (0, 0, 1), ""),
    "lstm bidirectional all": (lambda: nn.LSTM(3, 4, bidirectional=True), False, (1, 1, 1), ""),
    "lstm frozen first layer": (lambda: nn.LSTM(3, 4, 2, bidirectional=True, batch_first=True), True, (1, 1, 1),
                                "l0"),
    "gru 2 layers bidirectional hx": (lambda: nn.GRU(3, 4, 2, bidirectional=True, batch_first=True), True, (1, 1),
                                      ""),
    "gru no bias output": (lambda: nn.GRU(3, 4, bias=False, batch_first=True), False, (1, 0), ""),
    "gru h_n frozen hh": (lambda: nn.GRU(3, 4, 2), False, (0, 1), "weight_hh"),
}
T = 5


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("name", list(RECURRENT))
def test_recurrent(name, n):
    torch.manual_seed(0)
    make, with_hx, which, frozen = RECURRENT[name]
    layer = make().to(DT)
    for k, p in layer.named_parameters():
        p.requires_grad_(not (frozen and frozen in k))
    lstm = isinstance(layer, nn.LSTM)
    sample_dim = 0 if layer.batch_first else 1
    x = torch.randn((B, T, 3) if layer.batch_first else (T, B, 3), dtype=DT)
    states = layer.num_layers * (2 if layer.bidirectional else 1)
    h0 = torch.randn(states, B, 4, dtype=DT) if with_hx else torch.zeros(states, B, 4, dtype=DT)
    c0 = torch.randn(states, B, 4, dtype=DT) if with_hx else torch.zeros(states, B, 4, dtype=DT)
    hx = (h0, c0) if lstm else h0
    leaves = tree_leaves(layer(x, hx))
    grads = [torch.randn(n, *leaf.shape, dtype=DT) if w else None for leaf, w in zip(leaves, which, strict=True)]

    out = empty_out(layer, n, B)
    assert call_rule_for(layer) is recurrent
    recurrent(layer, (x, hx) if with_hx else (x,), grads, out)

    def call(p, xb, hb, cb):
        return tree_leaves(functional_call(layer, p, (xb, (hb, cb) if lstm else hb)))

    grad_dims = [sample_dim, 1, 1][:len(leaves)]
    dense = [torch.zeros(n, *leaf.shape, dtype=DT) if g is None else g for leaf, g in zip(leaves, grads, strict=True)]
    want = reference(layer, call, [x, h0, c0], [sample_dim, 1, 1], dense, grad_dims)
    assert set(out) == set(want) and len(want) > 0
    for k in want:
        torch.testing.assert_close(out[k], want[k], **TOL, msg=k)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize(("shape", "eps"), [((6,), None), ((4, 6), 1e-3)], ids=["last dim, default eps", "two dims"])
def test_rms_norm(shape, eps, n):
    torch.manual_seed(0)
    layer = nn.RMSNorm(shape, eps=eps, dtype=DT)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    check_single(layer, layer_norm, torch.randn(B, 5, *shape, dtype=DT), n)


def test_recurrent_refuses_what_it_does_not_cover():
    x = torch.randn(B, T, 3)
    lstm = nn.LSTM(3, 4, proj_size=2, batch_first=True)
    with pytest.raises(NotImplementedError, match="proj_size"):
        recurrent(lstm, (x,), [torch.ones(1, B, T, 2), None, None], empty_out(lstm, 1, B))
    gru = nn.GRU(3, 4, batch_first=True)
    packed = nn.utils.rnn.pack_padded_sequence(x, [5, 4, 2], batch_first=True)
    with pytest.raises(NotImplementedError, match="PackedSequence"):
        recurrent(gru, (packed,), [None, None], empty_out(gru, 1, B))
    with pytest.raises(NotImplementedError, match="unbatched"):
        recurrent(gru, (x[0],), [None, None], empty_out(gru, 1, B))


@pytest.mark.parametrize("kw", [
    dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=1),
    dict(in_channels=2, out_channels=5, kernel_size=(2, 3), padding="same", padding_mode="reflect", dilation=2),
    dict(in_channels=2, out_channels=3, kernel_size=3, padding="valid", bias=False),
], ids=["stride-pad", "same-reflect-dilation", "valid-nobias"])
@pytest.mark.parametrize("gram", [True, False])
def test_conv_ghost_norms_equal_the_dense_rule(kw, gram, monkeypatch):
    """The im2col Gram form of a Conv2d's per-sample gradient norms equals the norms of its dense rule's gradients."""
    from pergrad_viz.rules import conv as conv_rules
    from pergrad_viz.rules import ghost_rule_for
    from pergrad_viz.rules import linear as linear_rules

    torch.manual_seed(0)
    layer = nn.Conv2d(**kw).double()
    x = torch.randn(3, kw["in_channels"], 7, 6, dtype=torch.float64)
    g = torch.randn(1, *layer(x).shape, dtype=torch.float64)
    out = {n: torch.empty(1, 3, *p.shape, dtype=torch.float64) for n, p in layer.named_parameters()}
    conv_rules.conv(layer, x, g, out)
    ghost = ghost_rule_for(layer)
    assert ghost is conv_rules.ConvGhost
    monkeypatch.setattr(linear_rules, "gram_is_faster", lambda tokens, width_in, width_out: gram)
    a, gs = ghost.stack(layer, [(x, g)])
    got = ghost.squared_norms(layer, a, gs[0], set(out))
    for name, t in out.items():
        torch.testing.assert_close(got[name], t[0].flatten(1).square().sum(1), rtol=1e-10, atol=1e-12)
    assert ghost_rule_for(nn.Conv2d(4, 4, 3, groups=2)) is None  # grouped: the dense rule


@pytest.mark.parametrize("block", ["small", "large"])
def test_token_outer_sum_into_a_flat_result(block, monkeypatch):
    """Strided blocks of a flat (N, B, P) result are written through a temporary when small, straight when large."""
    from pergrad_viz.rules import linear

    if block == "large":
        monkeypatch.setattr(linear, "SMALL_BLOCK_BYTES", 0)
    g, a = torch.randn(2, B, 5, 4, dtype=DT), torch.randn(B, 5, 3, dtype=DT)
    flat = torch.full((2, B, 20), float("nan"), dtype=DT)
    dest = flat[:, :, 4:16].view(2, B, 4, 3)
    linear.token_outer_sum(g, a, dest)
    torch.testing.assert_close(dest, torch.einsum("nbto,bti->nboi", g, a), **TOL)
    assert flat[:, :, :4].isnan().all() and flat[:, :, 16:].isnan().all()


def test_token_outer_sum_in_out_layout():
    from pergrad_viz.rules import linear

    g, a = torch.randn(2, B, 5, 4, dtype=DT), torch.randn(B, 5, 3, dtype=DT)
    dest = torch.full((2, B, 3, 4), float("nan"), dtype=DT)
    linear.token_outer_sum(g, a, dest, in_out=True)
    torch.testing.assert_close(dest, torch.einsum("nbto,bti->nbio", g, a), **TOL)


# ------------------------------------------------------------------------- lazy registration by class path

class LazyScale(nn.Module):
    """A layer registered below by its class path only: x * weight on the last dimension."""

    def __init__(self, n: int = 4):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n, dtype=DT))

    def forward(self, x):
        return x * self.weight


class LazyPatched(LazyScale):
    """Registered by path, but its forward is replaced on the class before its first lookup."""

    def forward(self, x):
        return x * self.weight


class LazyOther(LazyScale):
    """Registered by path with a ``forward_like`` that its forward does not match."""

    def forward(self, x):
        return x * self.weight * 2


class KeepsForward(LazyScale):
    pass


class OverridesForward(LazyScale):
    def forward(self, x):
        return x * self.weight + 1


def _scale_forward(self, x):
    return x * self.weight


def _lazy_rule(module, activation, grad_output, out):
    n, batch = grad_output.shape[:2]
    d = activation.shape[-1]
    torch.sum(grad_output.reshape(n, batch, -1, d) * activation.reshape(batch, -1, d), dim=2, out=out["weight"])


def test_lazy_registration_by_class_path():
    from pergrad_viz import rules

    path = f"{__name__}.{{}}"
    rule = rules.register(*(path.format(c) for c in ("LazyScale", "LazyPatched", "LazyOther")),
                          features=lambda module: 1, forward_like=_scale_forward)(_lazy_rule)
    assert path.format("LazyScale") in rules.lazy_paths()
    LazyPatched.forward = lambda self, x: x * self.weight  # patched onto the class before its first lookup
    layer = LazyScale()
    assert rule_for(layer) is rule and path.format("LazyScale") not in rules.lazy_paths()
    check_single(layer, rule, torch.randn(B, 3, 4, dtype=DT), 3)
    assert rule_for(KeepsForward()) is rule  # a subclass keeping the forward
    assert rule_for(OverridesForward()) is None
    assert rule_for(LazyPatched()) is None
    assert rule_for(LazyOther()) is None  # a different forward than the rule's copy
    own = LazyScale.forward
    try:
        LazyScale.forward = _scale_forward  # patched after its first lookup: the rule knows the old one only
        assert rule_for(LazyScale()) is None
    finally:
        LazyScale.forward = own
    assert rule_for(LazyScale()) is rule


def test_import_does_not_import_the_integrated_libraries():
    import subprocess
    import sys

    code = ("import sys, pergrad_viz, pergrad_viz.rules; "
            "print(sorted(m for m in ('transformers', 'timm', 'peft') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# --------------------------------------------------------------------------- transformers and timm layers

def _transformers():
    pytest.importorskip("transformers", reason="Hugging Face transformers is not installed (pip install transformers)")


def _timm():
    return pytest.importorskip("timm", reason="timm is not installed (pip install timm)")


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("shape", [(4,), (5, 4)], ids=["(B, in)", "(B, T, in)"])
def test_hf_conv1d(shape, n):
    _transformers()
    from transformers.pytorch_utils import Conv1D

    from pergrad_viz.rules import ghost_rule_for
    from pergrad_viz.rules.integrations.transformers import conv1d
    from pergrad_viz.rules.linear import LinearInOutGhost

    torch.manual_seed(0)
    layer = Conv1D(6, 4).to(DT)  # weight (in=4, out=6)
    with torch.no_grad():
        layer.bias.normal_()
    check_single(layer, conv1d, torch.randn(B, *shape, dtype=DT), n)
    assert ghost_rule_for(layer) is LinearInOutGhost
    x = torch.randn(B, *shape, dtype=DT)
    g = torch.randn(1, B, *shape[:-1], 6, dtype=DT)
    out = empty_out(layer, 1, B)
    conv1d(layer, x, g, out)
    a, gs = LinearInOutGhost.stack(layer, [(x, g)])
    norms = LinearInOutGhost.squared_norms(layer, a, gs[0], set(out))
    for name, t in out.items():
        torch.testing.assert_close(norms[name], t[0].flatten(1).square().sum(1), **TOL, msg=name)
    gram, dense = LinearInOutGhost.gram_cost(layer, 5, 1, 1)
    assert dense == layer.weight.numel() and gram == 25 * (4 + 6) + 5 * 6


RMS_NORMS = {  # class path -> the rule it gets
    "transformers.models.llama.modeling_llama.LlamaRMSNorm": "llama_rms_norm",
    "transformers.models.mistral.modeling_mistral.MistralRMSNorm": "llama_rms_norm",
    "transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm": "llama_rms_norm",
    "transformers.models.olmo2.modeling_olmo2.Olmo2RMSNorm": "olmo_rms_norm",
    "transformers.models.t5.modeling_t5.T5LayerNorm": "t5_layer_norm",
}


def _class(path: str) -> type:
    import importlib

    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path", list(RMS_NORMS), ids=lambda p: p.rpartition(".")[2])
def test_hf_rms_norms(path, n):
    """In float64 these forwards compute the normalisation in float32: the rule repeats that to the last bit."""
    _transformers()
    from pergrad_viz.rules.integrations import transformers as hf_rules

    torch.manual_seed(0)
    layer = _class(path)(6, eps=1e-5).to(DT)
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
    check_single(layer, getattr(hf_rules, RMS_NORMS[path]), torch.randn(B, 5, 6, dtype=DT) * 3, n)


def test_every_registered_transformers_and_timm_class_resolves():
    """Each class path the integrations register exists in the installed releases and has the forward its rule was
    written for (a typo or a changed forward would leave it to the fallback, silently)."""
    _transformers()
    _timm()
    from pergrad_viz.rules.integrations import timm as timm_rules
    from pergrad_viz.rules.integrations import transformers as hf_rules

    paths = (hf_rules.CONV1D, *hf_rules.LLAMA_RMS_NORMS, *hf_rules.OLMO_RMS_NORMS, *hf_rules.T5_LAYER_NORMS,
             *timm_rules.PATHS)
    refused = []
    for path in paths:
        cls = _class(path)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.__dict__.update(_fast_norm=False, inplace=False, training=False, running_mean=0, running_var=0,
                               gamma=0, drop_path=nn.Identity())
        if rule_for(module) is None:
            refused.append(path)
    assert not refused


def test_gemma_style_rms_norm_gets_no_rule():
    _transformers()
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    assert rule_for(GemmaRMSNorm(6)) is None  # (1 + weight), in float32: not registered


@pytest.mark.parametrize("n", [1, 3])
def test_timm_layer_norms(n):
    timm = _timm()
    from timm.layers import LayerNorm, LayerNorm2d

    from pergrad_viz.rules.integrations.timm import layer_norm_2d, timm_layer_norm

    torch.manual_seed(0)
    for layer, rule, shape in ((LayerNorm(6), timm_layer_norm, (5, 6)), (LayerNorm2d(4), layer_norm_2d, (4, 3, 5))):
        layer = layer.to(DT)
        with torch.no_grad():
            layer.weight.uniform_(0.5, 1.5)
            layer.bias.normal_()
        check_single(layer, rule, torch.randn(B, *shape, dtype=DT) * 2 + 1, n)
        layer._fast_norm = True
        assert rule_for(layer) is None
    assert timm.__version__


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("act", ["silu", "relu_inplace", "identity"])
def test_timm_batch_norm_act_2d_eval(act, n):
    """The rule needs the gradient before the activation: the activation's vector-Jacobian product, recomputed."""
    _timm()
    from timm.layers import BatchNormAct2d

    from pergrad_viz.rules.integrations.timm import batch_norm_act_2d

    torch.manual_seed(0)
    kwargs = {"silu": dict(act_layer=nn.SiLU), "relu_inplace": dict(act_layer=nn.ReLU, act_kwargs={"inplace": True}),
              "identity": dict(apply_act=False)}[act]
    layer = BatchNormAct2d(4, **kwargs).to(DT).eval()
    with torch.no_grad():
        layer.weight.uniform_(0.5, 1.5)
        layer.bias.normal_()
        layer.running_mean.normal_()
        layer.running_var.uniform_(0.5, 2.0)
    check_single(layer, batch_norm_act_2d, torch.randn(B, 4, 3, 5, dtype=DT), n)
    assert rule_for(layer.train()) is None  # batch statistics (the api refuses them first)


@pytest.mark.parametrize("n", [1, 3])
def test_timm_layer_scale(n):
    _timm()
    from timm.layers import LayerScale, LayerScale2d

    from pergrad_viz.rules.integrations.timm import layer_scale, layer_scale_2d

    torch.manual_seed(0)
    for layer, rule, shape in ((LayerScale(6, init_values=0.5), layer_scale, (5, 6)),
                               (LayerScale2d(4, init_values=0.5), layer_scale_2d, (4, 3, 5))):
        layer = layer.to(DT)
        with torch.no_grad():
            layer.gamma.uniform_(0.5, 1.5)
        check_single(layer, rule, torch.randn(B, *shape, dtype=DT), n)
        layer.inplace = True
        assert rule_for(layer) is None  # it overwrites its input, which the rule needs


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("conv_mlp", [False, True])
def test_timm_convnext_block_layer_scale(n, conv_mlp):
    """ConvNeXtBlock's own gamma (its children keep their own rules: frozen here, so out holds gamma only)."""
    _timm()
    from timm.models.convnext import ConvNeXtBlock

    from pergrad_viz.rules.integrations.timm import convnext_block

    torch.manual_seed(0)
    block = ConvNeXtBlock(4, ls_init_value=0.5, conv_mlp=conv_mlp).to(DT).eval()
    with torch.no_grad():
        block.gamma.uniform_(0.5, 1.5)
    for name, p in block.named_parameters():
        p.requires_grad_(name == "gamma")
    check_single(block, convnext_block, torch.randn(B, 4, 5, 6, dtype=DT), n)
    block.drop_path = torch.nn.Dropout(0.5).train()  # not a path that passes x through: the fallback
    assert rule_for(block) is None
