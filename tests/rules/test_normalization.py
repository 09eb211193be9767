"""The normalised input a LayerNorm rule recomputes (``rules.normalization.layer_normalised``, with a weight of ones
for speed) is PyTorch's own, bit for bit; the rules' per-sample gradients are checked against loops elsewhere
(tests/rules/test_rules.py, tests/test_models.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pergrad_viz.rules.normalization import layer_normalised


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("shape", "normalized"), [((32, 32, 128), (128,)), ((5, 7, 3), (3,)),
                                                   ((4, 6, 8, 10), (8, 10))])
def test_layer_normalised_is_layer_norm_without_affine_bit_for_bit(dtype, shape, normalized):
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3 + 1).to(dtype)
    for t in (x, x.transpose(0, 1)):  # contiguous and strided
        want = F.layer_norm(t, normalized, eps=1e-5)
        got = layer_normalised(t, torch.Size(normalized), 1e-5)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_layer_normalised_under_inference_mode_is_a_normal_computation():
    x = torch.randn(3, 4, 11)  # a width no other test asks for: its ones are made here, under inference mode
    with torch.inference_mode():
        first = layer_normalised(x, torch.Size((11,)), 1e-5)
    assert torch.equal(first, F.layer_norm(x, (11,)))
    y = torch.randn(3, 4, 11, requires_grad=True)
    layer_normalised(y, torch.Size((11,)), 1e-5).sum().backward()  # those ones usable with autograd
    assert y.grad is not None
