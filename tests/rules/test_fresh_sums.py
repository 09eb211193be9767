"""Weighted-sum rules registered with ``writes_fresh=True`` (``pergrad_viz.rules.register_weighted_sum``) are handed
the clipped sum's tensors unwritten (allocated, not zeroed) the first time: their first contribution must write every
element, later ones (a second call of the layer, the next samples' columns) add. Checked on destinations full of
NaN: the result equals the definition (each sample's gradient by autograd, weighted, summed) for every configuration
with its own write path (a Linear on rows and on tokens, a convolution through its own kernel, by columns, by
columns with taps that read only padding, in 1D)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pergrad_viz.rules import conv, weighted_sum_rule_for, writes_fresh

B = 3


def _randn(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def _conv_calls(module, sizes):
    """[(input (B, C_in, *size), output gradient (B, C_out, *out size))] for each input size."""
    seen = []
    for size in sizes:
        a = _randn(B, module.in_channels, *size)
        seen.append((a, _randn(*module.double()(a).shape)))
    return seen


def _loop(module, seen, weights):
    """sum over calls and samples i of c_i times sample i's gradient of <module(a_i), g_i>, by autograd, one sample
    at a time."""
    params = dict(module.named_parameters())
    total = {ln: torch.zeros_like(p) for ln, p in params.items()}
    for a, g in seen:
        for i in range(B):
            grads = torch.autograd.grad((module(a[i:i + 1]) * g[i:i + 1]).sum(), list(params.values()))
            for (ln, _), gi in zip(params.items(), grads, strict=True):
                total[ln] += weights[ln][i] * gi
    return total


CASES = {
    "linear rows, two calls": lambda: (nn.Linear(5, 3), [(_randn(B, 5), _randn(B, 3)), (_randn(B, 5), _randn(B, 3))]),
    "linear tokens": lambda: (nn.Linear(5, 7, bias=False), [(_randn(B, 4, 5), _randn(B, 4, 7))]),
    "conv kernel, two calls": lambda: (m := nn.Conv2d(3, 4, 3, padding=1), _conv_calls(m, [(6, 6), (5, 5)])),
    "conv columns, dead taps": lambda: (m := nn.Conv2d(3, 4, 3, padding=1), _conv_calls(m, [(1, 1)])),
    "conv columns, 1x1": lambda: (m := nn.Conv2d(3, 4, 1), _conv_calls(m, [(1, 1), (1, 1)])),
    "conv1d": lambda: (m := nn.Conv1d(2, 3, 3, padding=2), _conv_calls(m, [(5,)])),
    "conv columns, a sample at a time": lambda: (m := nn.Conv2d(3, 4, 3), _conv_calls(m, [(3, 3)])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_unwritten_destination_is_written_whole(case, monkeypatch):
    monkeypatch.setattr(conv, "SUM_COLUMNS_BYTES", 1)  # the columns made a few samples at a time: several products
    torch.manual_seed(0)
    module, seen = CASES[case]()
    module = module.double()
    seen = [(a.detach(), g.detach()) for a, g in seen]
    rule = weighted_sum_rule_for(module)
    assert rule is not None and writes_fresh(rule)
    params = dict(module.named_parameters())
    weights = {ln: torch.rand(B, dtype=torch.float64) for ln in params}
    want = _loop(module, seen, weights)
    got = {ln: torch.full_like(p, float("nan")) for ln, p in params.items()}
    rule(module, seen, weights, got, list(got))
    for ln in params:
        torch.testing.assert_close(got[ln], want[ln], rtol=1e-12, atol=1e-12)
