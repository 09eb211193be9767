"""Convolutions: nn.Conv1d, nn.Conv2d, nn.Conv3d (any stride, padding (numbers, 'same', 'valid', any
padding_mode), dilation and groups) and nn.ConvTranspose1d/2d/3d (any stride, padding, output_padding,
dilation and groups; padding_mode 'zeros', the only one they allow).

Conv1d and Conv2d with groups=1 go through ``unfold`` (im2col). Grouped ones, Conv3d and the transposed convolutions
go through one correlation of the layer's input with its output gradient (:func:`_correlate`): a transposed
convolution is the adjoint of the convolution with the same weight, so its weight gradient is that of a convolution
whose input is the output gradient and whose output gradient is the input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pergrad_viz.rules.linear import LinearGhost
from pergrad_viz.rules.registry import join_positions, register, register_ghost, register_weighted_sum

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
    one_d = isinstance(module, nn.Conv1d)
    x = activation
    # The padding the layer applies (also for 'same' and non-zero padding modes), done explicitly.
    pad = list(module._reversed_padding_repeated_twice)
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(activation, pad, mode=mode)
    x = x.unsqueeze(-2) if one_d else x  # (B, C_in, H, W)
    kernel = (1, *module.kernel_size) if one_d else module.kernel_size
    dilation = (1, *module.dilation) if one_d else module.dilation
    stride = (1, *module.stride) if one_d else module.stride
    return F.unfold(x, kernel, dilation=dilation, stride=stride)


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
    def factors(module, a, g):
        return None  # a tied convolution keeps its per-sample gradients (its columns are not kept)

    @staticmethod
    def gram_cost(module, tokens, y_count, pairs):
        inputs, width = module.weight[0].numel(), module.out_channels
        gram = tokens * tokens * (inputs + y_count * width) + tokens * pairs * width
        return gram, pairs * module.weight.numel()


# The weighted sum's columns are made for as many samples at once as fit max(this, a quarter of the call's captures).
SUM_COLUMNS_BYTES = 1 << 20


@register_weighted_sum(nn.Conv1d, nn.Conv2d)
def conv_weighted_sum(module, seen, weights, out):
    """Used where the ghost rule applies (groups=1): the weight, as the matrix (C_out, C_in * k), += sum_b c_b
    G_b cols_b^T, the columns (im2col, as the layer sees its input) made a few samples at a time and one ``addmm_``
    per chunk straight into ``out`` (the convolution's own weight-gradient kernel takes workspaces several times the
    weight's size, 36 MB for a 512-channel 3 x 3 layer); bias: the c-weighted sum of the output gradients."""
    c_out = module.out_channels
    for a, g in seen:
        batch = g.shape[0]
        g3 = g.reshape(batch, c_out, -1)  # (B, C_out, L)
        per_sample = module.weight[0].numel() * g3.shape[-1] * a.element_size()  # one sample's columns
        step = max(1, max(SUM_COLUMNS_BYTES, (a.nbytes + g.nbytes) // 2) // per_sample)
        for ln, c in weights.items():
            c = c.to(g.dtype)
            if ln == "bias":  # (C_out,) += sum_b c_b (output gradient of b summed over positions)
                out[ln].addmv_(g3.sum(2).mT, c)
                continue
            rows = out[ln].view(c_out, -1)  # (C_out, C_in * k)
            for first in range(0, batch, step):
                r = slice(first, first + step)
                cols = _columns(module, a[r])  # (b, C_in * k, L)
                cg = g3[r] * c[r].view(-1, 1, 1)  # (b, C_out, L)
                rows.addmm_(cg.transpose(0, 1).reshape(c_out, -1), cols.transpose(1, 2).reshape(-1, cols.shape[1]))
                del cols, cg


def _conv_by_correlation(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                         weight: torch.Tensor) -> None:
    """Conv weight gradient (N, B, C_out, C_in/G, *kernel) from activation (B, C_in, *spatial)."""
    padding = module.padding
    if module.padding_mode != "zeros" or isinstance(padding, str):  # pad explicitly as the layer does
        pad = list(module._reversed_padding_repeated_twice)
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        activation = F.pad(activation, pad, mode=mode) if any(pad) else activation
        padding = (0,) * len(module.kernel_size)
    w = _correlate(activation.unsqueeze(0), grad_output, module.groups, module.kernel_size, module.stride,
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
    w = _correlate(grad_output, activation.unsqueeze(0), module.groups, module.kernel_size, module.stride,
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
