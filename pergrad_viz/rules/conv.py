"""Convolutions: nn.Conv1d, nn.Conv2d, nn.Conv3d (any stride, padding (numbers, 'same', 'valid', any padding_mode),
dilation and groups) and nn.ConvTranspose1d/2d/3d (any stride, padding, output_padding, dilation and groups;
padding_mode 'zeros', the only one they allow). Conv1d and Conv2d with groups=1 go through ``unfold`` (im2col).
Grouped ones, Conv3d and the transposed convolutions go through one correlation of the layer's input with its output
gradient (:func:`_correlate`): a transposed convolution is the adjoint of the convolution with the same weight, so
its weight gradient is that of a convolution whose input is the output gradient and whose output gradient is the input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pergrad_viz.rules.doubts import deferring
from pergrad_viz.rules.linear import LinearGhost, gram_is_cheaper, instantiating_is_cheaper
from pergrad_viz.rules.pixel_gram import pixel_gram
from pergrad_viz.rules.registry import join_positions, register, register_ghost, register_weighted_sum
from pergrad_viz.rules.scaling import scaled_unless_fit

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@register(nn.Conv1d, nn.Conv2d, nn.Conv3d)
def conv(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
         out: dict[str, torch.Tensor]) -> None:
    """activation (B, C_in, *spatial), grad_output (N, B, C_out, *spatial_out)."""
    n, batch = grad_output.shape[:2]
    c_out = module.out_channels
    if "bias" in out:
        torch.sum(grad_output.reshape(n, batch, c_out, -1), dim=-1, out=out["bias"])
    if "weight" not in out:
        return
    if isinstance(module, nn.Conv3d) or module.groups > 1:
        # Grouped (depthwise: ConvNeXt, MobileNet, EfficientNet): one correlation, 8-13x faster than im2col's
        # per-group products for a 7x7 depthwise layer on 2 cores (16 x 40 channels, 8x8: 138 against 1749 us).
        _conv_by_correlation(module, activation, grad_output, out["weight"])
        return
    cols = _columns(module, activation)  # (B, C_in * k, L)
    groups = module.groups
    cols = cols.view(batch, groups, -1, cols.shape[-1])  # (B, G, C_in/G * k, L)
    g = grad_output.reshape(n, batch, groups, c_out // groups, -1)  # (N, B, G, C_out/G, L)
    weight = out["weight"]
    if groups == 1 and weight[0, 0].is_contiguous():
        # Straight into the result (a strided view): one batched matmul per gradient row, no temporary.
        rows = weight.view(n, batch, c_out, -1)  # (N, B, C_out, C_in * k)
        for r in range(n):
            torch.bmm(g[r, :, 0], cols[:, 0].mT, out=rows[r])
        return
    w = torch.einsum("nbgol,bgil->nbgoi", g, cols)
    weight.copy_(w.reshape(weight.shape))


def _columns(module: nn.Module, activation: torch.Tensor) -> torch.Tensor:
    """im2col of a Conv1d / Conv2d input (B, C_in, *spatial) as the layer sees it: (B, C_in * k, L)."""
    x = _padded(module, activation)  # the padding the layer applies, done explicitly
    x = x.unsqueeze(-2) if isinstance(module, nn.Conv1d) else x  # (B, C_in, H, W)
    kernel, stride, dilation = _geometry(module)
    return im2col(x, kernel, stride, dilation)


def im2col(x: torch.Tensor, kernel: tuple[int, int], stride: tuple[int, int], dilation: tuple[int, int]
           ) -> torch.Tensor:
    """``F.unfold(x, kernel, dilation, stride)`` of a padded x (B, C, H, W): (B, C * kh * kw, L), the same values in
    the same order. Where an output row holds 1 or at least 4 positions, one copy of a strided view (2 cores, B=32:
    4.8x faster than ``F.unfold`` for ResNet-18's 7 x 7 stem on 32 x 32 images, 2.6x for a 64-channel 3 x 3 layer on
    8 x 8, 1.8x on 56 x 56, 50x on a 1 x 1 map); on rows of 2 or 3 positions that copy's innermost runs are too short
    and ``F.unfold`` is the faster (0.6-0.9x). On other devices (not measured here) ``F.unfold``."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    view = x.unfold(2, (kh - 1) * dh + 1, sh).unfold(3, (kw - 1) * dw + 1, sw)  # (B, C, H_o, W_o, span_h, span_w)
    if 2 <= view.shape[3] <= 3 or x.device.type != "cpu":  # measured on CPUs only: elsewhere F.unfold's kernel
        return F.unfold(x, kernel, dilation=dilation, stride=stride)
    view = view[..., ::dh, ::dw]  # (B, C, H_o, W_o, kh, kw)
    batch, channels, out_h, out_w = view.shape[:4]
    return view.permute(0, 1, 4, 5, 2, 3).reshape(batch, channels * kh * kw, out_h * out_w)


@register_ghost(nn.Conv1d, nn.Conv2d)
class ConvGhost(LinearGhost):
    """A convolution (groups=1) is a Linear from the C_in * k values of each patch to C_out, applied at the L output
    positions: its norms and NTK terms are those of that Linear on L positions, from the im2col columns."""

    kind = "conv"

    @staticmethod
    def applies(module):
        return module.groups == 1

    @staticmethod
    def stack(module, seen):
        acts, grads = [], []
        for a, g in seen:
            n, batch = g.shape[:2]
            acts.append(_columns(module, a).mT)  # (B, L, C_in * k)
            grads.append(g.reshape(n, batch, module.out_channels, -1).mT)  # (N, B, L, C_out)
        return join_positions(acts, grads)

    @staticmethod
    def direct_bytes(module, seen):
        # Where the Gram form is taken, the pixels' Gram without im2col if it has at most 4x the columns' Gram's
        # products or is no larger than one sample's columns (2 cores, B=16-32: 2-4x faster for ResNet-18's 3 x 3
        # layers on 8 x 8 to 1 x 1 maps). Elsewhere the columns (:func:`im2col`, a strided copy) and each sample's
        # gradient: 1.2-1.7x faster than one correlation on 16 x 16 to 32 x 32 maps, within 10% on larger ones.
        if len(seen) != 1:
            return None
        x, g = seen[0]
        tokens, elem = math.prod(g.shape[2:]), g.element_size()
        if not gram_is_cheaper(tokens, module.weight.numel()):
            return None
        pad = _pad_amounts(module)
        positions = math.prod(size + pad[2 * k] + pad[2 * k + 1] for k, size in enumerate(reversed(x.shape[2:])))
        kernel = module.weight.shape
        limit = max(4 * math.prod(kernel[2:]) * tokens * tokens, tokens * math.prod(kernel[1:]))
        if positions * positions > limit:
            return None
        # the padded pixels' Gram, the columns' and gradients' Grams; and the input's own pixels' Gram (where zero
        # padding pads the Gram) or the padded input (few channels, or padding made of the input's own values)
        pixels = math.prod(x.shape[2:])
        before = max(pixels * pixels if module.padding_mode == "zeros" else 0, x.shape[1] * positions)
        return (positions * positions + 2 * tokens * tokens + before) * elem

    @staticmethod
    def direct_norms(module, seen, local):
        return _direct_norms(module, *seen[0], local)

    @staticmethod
    def instantiates(module, seen):
        if len(seen) != 1:
            return False
        # as a Linear from the C_in * k values of each patch (ResNet-18's RGB stem on 32 x 32 images); where the
        # pixels' Gram would be taken (direct_bytes) this may replace it too: not measured apart
        x, g = seen[0]
        return instantiating_is_cheaper(math.prod(g.shape[2:]), math.prod(module.weight.shape[1:]), module.out_channels,
                                        x.shape[0], module.weight.numel(), x.numel() + g.numel())

    @staticmethod
    def factors(module, a, g):
        return None  # a tied convolution keeps its per-sample gradients (its columns are not kept)

    @staticmethod
    def gram_cost(module, tokens, y_count, pairs):
        inputs, width = math.prod(module.weight.shape[1:]), module.out_channels
        gram = tokens * tokens * (inputs + y_count * width) + tokens * pairs * width
        return gram, pairs * module.weight.numel()


def _direct_norms(module, x, g, local) -> dict[str, torch.Tensor]:
    """{local name: (B,)} from the input x (B, C_in, *S) and g (B, C_out, *S_o): the weight's from the pixels' Gram of
    the live taps' window (:func:`live_window`), the bias's ||sum_t g_t||^2. x and g are scaled per sample first
    where a square could overflow or underflow (:func:`~pergrad_viz.rules.scaling.products_fit`), before the padding,
    which holds no larger value."""
    noting = deferring(x, g) and "weight" in local  # a caller reads the Grams' range later (a GPU: no read here)
    if noting:
        scale = bias_scale = None
    else:
        x, g, scale, bias_scale = scaled_unless_fit(x, g, math.prod(g.shape[2:]) ** 2 * module.weight.numel())
    result = {}
    if "weight" in local:
        part, pads, kernel, _ = window_parts(module, x, g.shape[2:])
        _, stride, dilation = _geometry(module)
        weight = pixel_gram(part, pads, g.unsqueeze(-2) if isinstance(module, nn.Conv1d) else g, kernel, stride,
                            dilation, noting)
        result["weight"] = weight if scale is None else weight.to(scale.dtype) * scale
    if "bias" in local:
        bias = g.reshape(g.shape[0], g.shape[1], -1).sum(2).square().sum(1)
        result["bias"] = bias if bias_scale is None else bias.to(bias_scale.dtype) * bias_scale
    return result


def _geometry(module: nn.Module) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
    """(kernel, stride, dilation) of a Conv1d / Conv2d as a Conv2d's (a Conv1d's with a leading 1)."""
    if isinstance(module, nn.Conv1d):
        return (1, *_kernel(module)), (1, *module.stride), (1, *module.dilation)
    return _kernel(module), module.stride, module.dilation


def _kernel(module: nn.Module) -> tuple[int, ...]:
    return tuple(module.weight.shape[2:])  # as the forward sees it (kernel_size is stale after a weight is replaced)


def live_window(module: nn.Module, x: torch.Tensor, out_shape: tuple[int, ...]
          ) -> tuple[torch.Tensor, tuple[int, int], tuple[slice, slice] | None]:
    """(the part of x padded as the layer pads it that the taps read, (B, C_in, H_p, W_p) as a Conv2d's input; the
    kernel's extent; its taps): :func:`window_parts` with its zero padding applied."""
    part, pads, kernel, taps = window_parts(module, x, out_shape)
    return (F.pad(part, pads) if any(pads) else part), kernel, taps


def window_parts(module: nn.Module, x: torch.Tensor, out_shape: tuple[int, ...]
                 ) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, int], tuple[slice, slice] | None]:
    """(x's part that the live taps read, (B, C_in, H, W) as a Conv2d's input; the zero padding around it that
    makes the window, in ``F.pad``'s order (W's left and right, then H's); the kernel's extent; its taps). The window
    is x padded as the layer pads it, cut to the positions the taps read at the ``out_shape`` output positions
    (padding never read is not made); where every tap reads an input value at some output position, taps is None;
    where some read only zero padding at every one (a 3 x 3 kernel on a 1 x 1 map: all but its centre, whose
    gradient and norm terms are then exactly zero), the window holds the others': their extent and their slices of
    the kernel, which the same stride and dilation turn into the same output positions."""
    one_d = isinstance(module, nn.Conv1d)
    kernel, stride, dilation = _geometry(module)
    if module.padding_mode != "zeros":  # padding made of the input's own values: every tap reads some
        padded = _padded(module, x)
        return (padded.unsqueeze(-2) if one_d else padded), (0, 0, 0, 0), kernel, None
    part = x.unsqueeze(-2) if one_d else x
    out = (1, *out_shape) if one_d else tuple(out_shape)
    rev = _pad_amounts(module)
    lefts = (0, rev[0]) if one_d else (rev[2], rev[0])
    taps, pads = [], []
    for dim, (left, k, s, d, o) in enumerate(zip(lefts, kernel, stride, dilation, out, strict=True)):
        size = part.shape[2 + dim]
        live = [t for t in range(k) if _reads_input(t * d - left, s, o, size)]
        first, stop = (live[0], live[-1] + 1) if live else (0, 1)
        taps.append(slice(first, stop))
        start = first * d - left  # the window's first position, in x's own
        length = (o - 1) * s + d * (stop - first - 1) + 1
        lo = min(max(start, 0), size)
        hi = min(max(start + length, lo), size)
        before = min(length, max(0, lo - start))
        part = part.narrow(2 + dim, lo, hi - lo)
        pads.append((before, length - before - (hi - lo)))
    flat = (*pads[1], *pads[0])
    if all(t.stop - t.start == k for t, k in zip(taps, kernel, strict=True)):
        return part, flat, kernel, None
    return part, flat, tuple(t.stop - t.start for t in taps), (taps[0], taps[1])


def _reads_input(offset: int, stride: int, outputs: int, size: int) -> bool:
    """Whether a tap at ``offset`` from an output's first input position reads one of the ``size`` input positions
    (0 .. size - 1) at some output j < ``outputs``: offset + j * stride in range."""
    j = max(0, -(offset // stride))  # the first j with offset + j * stride >= 0
    return j < outputs and offset + j * stride < size


def _pad_amounts(module: nn.Module) -> list[int]:
    """The padding the layer's forward applies now, in ``F.pad``'s order: zero padding from ``padding`` and
    ``dilation`` as they are (set after construction too), another mode from the amounts its forward pads by."""
    if module.padding_mode != "zeros":  # computed at construction
        return list(module._reversed_padding_repeated_twice)
    if not isinstance(module.padding, str):
        return [p for p in reversed(module.padding) for _ in range(2)]
    same = module.padding == "same"  # as the convolution pads: an odd one extra on the right
    totals = [d * (k - 1) * same for d, k in zip(reversed(module.dilation), reversed(_kernel(module)), strict=True)]
    return [p for total in totals for p in (total // 2, total - total // 2)]


def _padded(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's input (B, C_in, *spatial) padded as the layer pads it (numbers, 'same', any padding mode)."""
    pad = _pad_amounts(module)
    if not any(pad):
        return x
    return F.pad(x, pad, mode="constant" if module.padding_mode == "zeros" else module.padding_mode)


# Output maps of at most this many positions take im2col and one matmul for the weighted sum, larger ones the
# convolution's own weight-gradient kernel: on 2 cores (oneDNN) the kernel took 12.0 ms for a 512-channel 3 x 3 layer
# on a 1 x 1 map at B=32 against 2.4 ms for the columns, 2.1 against 2.6 ms for a 256-channel one on 2 x 2, and 1.7
# against 3.2 ms for a 64-channel one on 8 x 8.
SMALL_MAP = 1
# The columns are made for as many samples at once as fit max(this, half the call's captures).
SUM_COLUMNS_BYTES = 1 << 20


@register_weighted_sum(nn.Conv1d, nn.Conv2d, writes_fresh=True)
def conv_weighted_sum(module, seen, weights, out, fresh=()):
    """Used where the ghost rule applies (groups=1): the weight += the weight gradient of the input and the output
    gradient with each sample's rows times c_b: the convolution's own kernel (the one plain training's backward
    runs), or on small maps im2col and one ``addmm_`` straight into ``out``; bias: the c-weighted sum of the output
    gradients. A ``fresh`` tensor's first contribution is written, not added."""
    c_out = module.out_channels
    fresh = set(fresh)
    for a, g in seen:
        batch = g.shape[0]
        for ln, c in weights.items():
            c = c.to(g.dtype)
            first = ln in fresh
            fresh.discard(ln)
            if ln == "bias":  # (C_out,) += sum_b c_b (output gradient of b summed over positions)
                out[ln].addmv_(g.reshape(batch, c_out, -1).sum(2).mT, c, beta=0 if first else 1)
                continue
            scaled = g * c.view(-1, *(1,) * (g.dim() - 1))
            if math.prod(g.shape[2:]) <= SMALL_MAP:
                _sum_by_columns(module, a, scaled, out[ln], first)
                continue
            x, padding = _explicit(module, a)
            grad = torch.ops.aten.convolution_backward(
                scaled, x, module.weight.detach(), None, module.stride, padding, module.dilation, False,
                (0,) * len(module.kernel_size), module.groups, (False, True, False))[1]
            if first:
                out[ln].copy_(grad)
            else:
                out[ln].add_(grad)
            del scaled, grad


def _sum_by_columns(module: nn.Module, a: torch.Tensor, g: torch.Tensor, weight: torch.Tensor,
                    fresh: bool = False) -> None:
    """weight (C_out, C_in, *k) += sum_b g_b cols_b^T, the columns of the live taps (:func:`live_window`) made a few
    samples at a time (``fresh``: the weight holds no values yet, and is written)."""
    batch, c_out = g.shape[:2]
    g3 = g.reshape(batch, c_out, -1)  # (B, C_out, L)
    x, kernel, taps = live_window(module, a, g.shape[2:])
    full_kernel, stride, dilation = _geometry(module)
    cells = module.in_channels * kernel[0] * kernel[1]
    if taps is not None and fresh:  # the taps that read only padding stay zero
        weight.zero_()
    rows = weight.view(c_out, -1) if taps is None else weight.new_zeros(c_out, cells)
    per_sample = cells * g3.shape[-1] * a.element_size()  # one sample's columns
    step = max(1, max(SUM_COLUMNS_BYTES, (a.nbytes + g.nbytes) // 2) // per_sample)
    for first in range(0, batch, step):
        r = slice(first, first + step)
        cols = im2col(x[r], kernel, stride, dilation)  # (b, cells, L)
        beta = 0 if first == 0 and fresh and taps is None else 1
        rows.addmm_(g3[r].transpose(0, 1).reshape(c_out, -1), cols.transpose(1, 2).reshape(-1, cells), beta=beta)
        del cols
    if taps is not None:  # tap by tap: one add into the whole strided window took 10x as long
        full = weight.view(c_out, module.in_channels, *full_kernel)
        part = rows.view(c_out, module.in_channels, *kernel)
        for u in range(kernel[0]):
            for v in range(kernel[1]):
                full[:, :, taps[0].start + u, taps[1].start + v].add_(part[:, :, u, v])


def _explicit(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(x, padding) for ``convolution_backward``: the layer's own numeric zero padding left to the call; 'same'
    or another padding mode applied to x explicitly."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return x, module.padding
    return _padded(module, x), (0,) * len(module.kernel_size)


def _conv_by_correlation(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                         weight: torch.Tensor) -> None:
    """Conv weight gradient (N, B, C_out, C_in/G, *kernel) from activation (B, C_in, *spatial)."""
    activation, padding = _explicit(module, activation)  # 'same' and other modes padded as the layer does
    w = _correlate(activation.unsqueeze(0), grad_output, module.groups, _kernel(module), module.stride,
                   module.dilation, padding)
    weight.copy_(w)


@register(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
def conv_transpose(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                   out: dict[str, torch.Tensor]) -> None:
    """activation (B, C_in, *spatial), grad_output (N, B, C_out, *spatial_out) (any output_padding or
    output_size: only the output gradient's shape matters); weight (C_in, C_out/G, *kernel)."""
    n, batch = grad_output.shape[:2]
    if "bias" in out:
        torch.sum(grad_output.reshape(n, batch, module.out_channels, -1), dim=-1, out=out["bias"])
    if "weight" not in out:
        return
    if module.padding_mode != "zeros":
        raise NotImplementedError(f"{type(module).__name__} with padding_mode={module.padding_mode!r}")
    # y = conv(., W)^T x, so dW of the transposed convolution = dW of conv with input y's gradient and
    # output gradient x: the roles of activation and grad_output swap.
    w = _correlate(grad_output, activation.unsqueeze(0), module.groups, _kernel(module), module.stride,
                   module.dilation, module.padding)
    out["weight"].copy_(w)


def _correlate(inp: torch.Tensor, gout: torch.Tensor, groups: int, kernel: tuple[int, ...], stride: tuple[int, ...],
               dilation: tuple[int, ...], padding: tuple[int, ...]) -> torch.Tensor:
    """Per-sample weight gradient of ``y = conv(inp, W)`` (stride, dilation, groups, zero padding) given dL/dy.

    inp (Ni, B, C_i, *S) and gout (No, B, C_o, *S_out), with Ni or No equal to 1 (the N output gradients
    are on one side); returns (N, B, C_o, C_i/G, *kernel) with N = max(Ni, No):
    ``dW[n, b, o, i, k] = sum_p gout[n, b, o, p] * inp_padded[n, b, i, stride * p + dilation * k]``.

    One call of conv{1,2,3}d: the samples and groups fold into the groups of the call (B * G groups, one
    channel each), the input channels of a group and Ni into its batch, the output gradient is the kernel, and
    stride and dilation swap roles.
    """
    ni, batch, c_i = inp.shape[:3]
    no, _, c_o = gout.shape[:3]
    spatial, spatial_out = inp.shape[3:], gout.shape[3:]
    dims = len(kernel)
    cig, cog = c_i // groups, c_o // groups
    # (Ni, B, G, C_i/G, *S) -> (Ni * C_i/G, B * G, *S)
    x = inp.reshape(ni, batch, groups, cig, *spatial).movedim(3, 1).reshape(ni * cig, batch * groups, *spatial)
    # (No, B, G, C_o/G, *S_out) -> (B * G * No * C_o/G, 1, *S_out)
    k = gout.reshape(no, batch, groups, cog, *spatial_out).movedim(0, 2)
    k = k.reshape(batch * groups * no * cog, 1, *spatial_out)
    r = _CONV[dims](x, k, stride=dilation, padding=padding, dilation=stride, groups=batch * groups)
    # r: (Ni * C_i/G, B * G * No * C_o/G, *K') with K' >= kernel (positions past the last tap are cut off)
    r = r[(..., *(slice(0, size) for size in kernel))]
    r = r.reshape(ni, cig, batch, groups, no, cog, *kernel)
    r = r.permute(0, 4, 2, 3, 5, 1, *range(6, 6 + dims))  # (Ni, No, B, G, C_o/G, C_i/G, *kernel)
    return r.reshape(ni * no, batch, c_o, cig, *kernel)
