"""nn.Conv1d and nn.Conv2d: any stride, padding (numbers, 'same', 'valid', any padding_mode),
dilation and groups, through ``unfold`` (im2col)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import register


@register(nn.Conv1d, nn.Conv2d)
def conv(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
         out: dict[str, torch.Tensor]) -> None:
    n, batch = grad_output.shape[:2]
    c_out = module.out_channels
    if "bias" in out:
        torch.sum(grad_output.reshape(n, batch, c_out, -1), dim=-1, out=out["bias"])
    if "weight" not in out:
        return
    one_d = isinstance(module, nn.Conv1d)
    x = activation.unsqueeze(-2) if one_d else activation  # (B, C_in, H, W)
    # The padding the layer applies (also for 'same' and non-zero padding modes), done explicitly.
    pad = list(module._reversed_padding_repeated_twice)
    if any(pad):
        mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(activation, pad, mode=mode)
        x = x.unsqueeze(-2) if one_d else x
    kernel = (1, *module.kernel_size) if one_d else module.kernel_size
    dilation = (1, *module.dilation) if one_d else module.dilation
    stride = (1, *module.stride) if one_d else module.stride
    cols = F.unfold(x, kernel, dilation=dilation, stride=stride)  # (B, C_in * k, L)
    groups = module.groups
    cols = cols.view(batch, groups, -1, cols.shape[-1])  # (B, G, C_in/G * k, L)
    g = grad_output.reshape(n, batch, groups, c_out // groups, -1)  # (N, B, G, C_out/G, L)
    w = torch.einsum("nbgol,bgil->nbgoi", g, cols)
    out["weight"].copy_(w.reshape(out["weight"].shape))
