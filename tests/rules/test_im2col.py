"""``rules.conv.im2col`` against ``F.unfold``: the same tensor bit for bit, on every branch it takes (output rows of
1, 2, 3 and more positions), with strides, dilations, offset views of a padded input and channels-last memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pergrad_viz.rules.conv import im2col

CASES = [  # (input shape, kernel, stride, dilation)
    ((3, 3, 38, 38), (7, 7), (2, 2), (1, 1)),  # an RGB stem
    ((2, 5, 10, 10), (3, 3), (1, 1), (1, 1)),  # 8 x 8 outputs
    ((2, 5, 4, 4), (3, 3), (1, 1), (1, 1)),  # 2 x 2: F.unfold's branch
    ((2, 5, 5, 5), (3, 3), (1, 1), (1, 1)),  # 3 x 3: F.unfold's branch
    ((2, 5, 3, 3), (3, 3), (1, 1), (1, 1)),  # 1 x 1
    ((2, 4, 9, 11), (2, 3), (2, 3), (1, 1)),  # uneven kernel and strides
    ((2, 4, 13, 13), (3, 3), (1, 2), (2, 3)),  # dilation
    ((2, 4, 1, 20), (1, 5), (1, 1), (1, 2)),  # a Conv1d's, as a Conv2d's
    ((2, 4, 8, 8), (1, 1), (2, 2), (1, 1)),  # a strided 1 x 1 (downsampling)
    ((2, 4, 6, 6), (1, 1), (1, 1), (1, 1)),  # a 1 x 1: the reshape may return a view of x
]


@pytest.mark.parametrize(("shape", "kernel", "stride", "dilation"), CASES)
@pytest.mark.parametrize("layout", ["contiguous", "offset-view", "channels-last"])
def test_im2col_equals_unfold(shape, kernel, stride, dilation, layout):
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    if layout == "offset-view":  # a window cut from a larger padded input, as live_window hands it
        x = torch.nn.functional.pad(x, (1, 2, 2, 1))[:, :, 2:-1, 1:-2]
    elif layout == "channels-last":
        x = x.contiguous(memory_format=torch.channels_last)
    want = F.unfold(x, kernel, dilation=dilation, stride=stride)
    got = im2col(x, kernel, stride, dilation)
    assert got.shape == want.shape
    assert torch.equal(got, want)
