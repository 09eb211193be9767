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
    monkeypatch.setattr(linear_rules, "gram_is_cheaper", lambda tokens, params: gram)
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
