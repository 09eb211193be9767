"""A convolution's ghost norm from the pixels' Gram (:mod:`pergrad_viz.rules.conv`'s direct norms for Conv1d / Conv2d
with groups=1): ``||sum_t g_t col_t^T||^2 = sum_{t,s} <col_t, col_s> (g_t . g_s)`` over the L output positions, the
columns' Gram summed from strided views of the pixels' Gram. Where the positions' terms cancel (pixels sharing a
large part, output gradients of opposite signs) a narrow dtype loses every digit of that sum (norms 0 and 6.9 for
0.26): such samples are computed again in float64 (:func:`pergrad_viz.rules.linear.cancelling`'s rule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pergrad_viz.rules.doubts import gram_tops, note_tops
from pergrad_viz.rules.linear import below_rounding, guarded


def pixel_gram(x: torch.Tensor, pads: tuple[int, ...], g: torch.Tensor, kernel: tuple[int, int],
               stride: tuple[int, int], dilation: tuple[int, int], noting: bool = False) -> torch.Tensor:
    """(B,) from x (B, C_in, H, W) and g (B, C_out, H_o, W_o) (a Conv1d's with H = 1), x the part of the input that
    the live taps read and ``pads`` the zeros around it that make their window (``F.pad``'s order), ``kernel`` their
    extent (``conv.window_parts``): the pixels' Gram of x padded with zeros where its channels make that cheaper than
    padding x (:func:`_grams`); the columns' Gram <col_t, col_s> = sum over the taps of the pixels' Gram at the
    taps' positions, each tap one strided view of the pixels' Gram (B, H_p, W_p, H_p, W_p), summed over the kernel's
    columns first, then its rows; then sum_{t,s} <col_t, col_s> (g_t . g_s) as for a Linear. ``noting``: both Grams
    noted for the open layer (:func:`~pergrad_viz.rules.doubts.note_grams`; a sum of at most L^2 k entries of each,
    L output positions, k taps), with the samples whose terms may cancel; else those computed again at once, their
    weight gradients formed in float64."""
    columns, grads, top_x = _grams(x, pads, g, kernel, stride, dilation, noting)
    weight = (columns * grads).sum((1, 2, 3, 4)).clamp_min(0)
    cancelled = _cancelling(weight, columns, grads, x.shape[1] * kernel[0] * kernel[1], g.shape[1])
    if noting:
        top_g = _diagonal(grads).amax((1, 2))
        note_tops(torch.stack([top_x, top_g]), (g.shape[-2] * g.shape[-1]) ** 2 * kernel[0] * kernel[1], x.shape[1],
                  g.shape[1], (x.dtype, g.dtype), cancelled)
        return weight
    rows = cancelled.nonzero().flatten() if guarded(columns, grads) else None  # none can be: no host read
    if rows is not None and rows.numel():  # their gradients formed in float64: what cancels rounded once, not squared
        weight[rows] = _explicit(F.pad(x[rows].double(), pads), g[rows].double(), kernel, stride,
                                 dilation).to(weight.dtype)
    return weight


def _explicit(x: torch.Tensor, g: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int],
              dilation: tuple[int, int]) -> torch.Tensor:
    """(R,) squared norms of the samples' weight gradients (C_out, C_in, *kernel), each its convolution's own weight
    gradient of x (R, C_in, H_p, W_p) (padded: no padding here) and g (R, C_out, H_o, W_o), one sample at a time."""
    weight = torch.empty(g.shape[1], x.shape[1], *kernel, dtype=x.dtype, device=x.device)
    norms = []
    for r in range(x.shape[0]):
        grad = torch.ops.aten.convolution_backward(g[r:r + 1], x[r:r + 1], weight, None, stride, (0, 0), dilation,
                                                   False, (0, 0), 1, (False, True, False))[1]
        norms.append(grad.square().sum())
    return torch.stack(norms)


def _grams(x: torch.Tensor, pads: tuple[int, ...], g: torch.Tensor, kernel: tuple[int, int],
           stride: tuple[int, int], dilation: tuple[int, int], noting: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(the columns' Gram, the output gradients' Gram, both (B, H_o, H_o, W_o, W_o); the pixels' Gram's maxima (B,)
    where ``noting``)."""
    inner = x.shape[2] * x.shape[3]
    padded = (x.shape[2] + pads[2] + pads[3]) * (x.shape[3] + pads[0] + pads[1])
    # the input padded instead where every tap reads padding only (the Gram of the zeros), or where its few channels
    # make that cheaper than the Gram's padding (1 thread, B=32, 3 x 3 taps: the Gram padded 1.1x as long for 3 to 16
    # channels on 8 x 8 to 16 x 16 maps, 0.5-0.9x for 32 to 128 on 4 x 4 to 8 x 8)
    if any(pads) and (inner == 0 or x.shape[1] * (padded * padded - inner * inner) <= 10 * padded * padded):
        x, pads = F.pad(x, pads), (0, 0, 0, 0)
    batch, c_in, height, width = x.shape
    out_h, out_w = g.shape[-2:]
    pixels = x.reshape(batch, c_in, -1)
    pixels_gram = torch.bmm(pixels.mT, pixels)  # (B, H W, H W)
    top_x = gram_tops(pixels_gram) if noting else None
    gram = pixels_gram.view(batch, height, width, height, width)
    if any(pads):  # (B, H_p, W_p, H_p, W_p): the padding's rows and columns are zeros
        gram = F.pad(gram, (*pads, *pads))
    # (B, H_p, H_p, W_p, W_p): summed over the kernel's columns, then its rows (a 5-D strided view a tap took 1.8x
    # as long: its innermost run is one output row)
    gram = gram.permute(0, 1, 3, 2, 4)
    del pixels_gram
    across = None
    for v in range(kernel[1]):
        cols = slice(v * dilation[1], v * dilation[1] + (out_w - 1) * stride[1] + 1, stride[1])
        across = gram[:, :, :, cols, cols].clone() if across is None else across.add_(gram[:, :, :, cols, cols])
    del gram
    columns = None
    for u in range(kernel[0]):
        rows = slice(u * dilation[0], u * dilation[0] + (out_h - 1) * stride[0] + 1, stride[0])
        columns = across[:, rows, rows].clone() if columns is None else columns.add_(across[:, rows, rows])
    del across
    g3 = g.reshape(batch, g.shape[1], -1)
    grads = torch.bmm(g3.mT, g3).view(batch, out_h, out_w, out_h, out_w).permute(0, 1, 3, 2, 4)
    return columns, grads, top_x


def _cancelling(weight: torch.Tensor, columns: torch.Tensor, grads: torch.Tensor, width_a: int,
                width_g: int) -> torch.Tensor:
    """(B,) bool: the samples whose norm ``weight`` may have lost its digits to the positions' terms cancelling
    (:func:`~pergrad_viz.rules.linear.below_rounding` of sum_t |col_t|^2 |g_t|^2, the Grams' diagonals, over the L
    positions); float32 and float64 (:func:`~pergrad_viz.rules.linear.guarded`)."""
    if not guarded(columns, grads):
        return torch.zeros_like(weight, dtype=torch.bool)
    usual = (_diagonal(columns) * _diagonal(grads)).sum((1, 2)).to(weight.dtype)
    return below_rounding(weight, usual, width_a, width_g, columns.shape[1] * columns.shape[3], columns.dtype)


def _diagonal(gram: torch.Tensor) -> torch.Tensor:
    """(B, H_o, W_o): the entries (t, t) of a Gram laid out (B, H_o, H_o, W_o, W_o)."""
    return gram.diagonal(dim1=1, dim2=2).diagonal(dim1=1, dim2=2)
