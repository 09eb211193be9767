"""nn.PReLU: y = max(0, x) + w * min(0, x), with one slope or one per channel (dimension 1)."""

from __future__ import annotations

import torch
from torch import nn

from pergrad_viz.rules.registry import register


@register(nn.PReLU)
def prelu(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
          out: dict[str, torch.Tensor]) -> None:
    if "weight" not in out:
        return
    n, batch = grad_output.shape[:2]
    contribution = grad_output * activation.clamp(max=0)  # (N, B, ...)
    if module.num_parameters == 1 or activation.dim() < 2:
        torch.sum(contribution.reshape(n, batch, 1, -1), dim=-1, out=out["weight"])
    else:
        channels = activation.shape[1]
        torch.sum(contribution.reshape(n, batch, channels, -1), dim=-1, out=out["weight"])
