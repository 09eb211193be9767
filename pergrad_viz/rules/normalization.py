"""nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, InstanceNorm (affine) and BatchNorm in eval mode (running statistics):
the affine weight's gradient is the output gradient times the normalised input, summed over the positions it
scales."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pergrad_viz.rules.registry import register


def affine_sums(xhat: torch.Tensor, grad_output: torch.Tensor, positions: int, out: dict[str, torch.Tensor],
            shape: torch.Size) -> None:
    """xhat (B, ...) and grad_output (N, B, ...) viewed as (N, B, positions, *shape) summed over positions."""
    n, batch = grad_output.shape[:2]
    g = grad_output.reshape(n, batch, positions, -1)
    if "weight" in out:  # summed straight into the result (a kernel fewer than a sum, then a copy)
        torch.sum(g * xhat.reshape(batch, positions, -1), dim=2, out=out["weight"].view(n, batch, -1))
    if "bias" in out:
        torch.sum(g, dim=2, out=out["bias"].view(n, batch, -1))


_ONES: dict[tuple[torch.Size, torch.dtype, torch.device], torch.Tensor] = {}  # read only


def layer_normalised(x: torch.Tensor, shape: torch.Size, eps: float) -> torch.Tensor:
    """x (..., *shape) normalised over its last dimensions, as ``F.layer_norm(x, shape, eps=eps)`` gives it, bit for
    bit, but with a weight of ones: on CPUs PyTorch 2.14's kernel without a weight is the slower one (2x on (32, 32,
    128), (32, 197, 192) and (8, 64, 768) floats, 2 threads), and times 1 rounds nothing."""
    key = (shape, x.dtype, x.device)
    ones = _ONES.get(key)
    if ones is None:
        with torch.inference_mode(False):
            ones = _ONES[key] = torch.ones(shape, dtype=x.dtype, device=x.device)
    return F.layer_norm(x, shape, ones, eps=eps)


@register(nn.LayerNorm, nn.RMSNorm, features=lambda module: len(module.normalized_shape))
def layer_norm(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
               out: dict[str, torch.Tensor]) -> None:
    """LayerNorm and RMSNorm: the input normalised over the last dimensions, then scaled (and shifted)."""
    shape = torch.Size(module.normalized_shape)
    if isinstance(module, nn.RMSNorm):
        xhat = F.rms_norm(activation, shape, eps=module.eps)
    else:
        xhat = layer_normalised(activation, shape, module.eps)
    positions = activation[0].numel() // shape.numel()
    affine_sums(xhat, grad_output, positions, out, shape)


@register(nn.GroupNorm)
def group_norm(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
               out: dict[str, torch.Tensor]) -> None:
    xhat = F.group_norm(activation, module.num_groups, eps=module.eps)
    per_channel(xhat, grad_output, out)


@register(nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
def batch_norm_eval(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                    out: dict[str, torch.Tensor]) -> None:
    # Only reached in eval mode with running statistics: api refuses batch statistics. The input is centred, the
    # (B, C) sums scaled by 1 / sqrt(var + eps) afterwards: two temporaries of the input's size, not three.
    view = (1, -1) + (1,) * (activation.dim() - 2)
    per_channel(activation - module.running_mean.view(view), grad_output, out,
                torch.rsqrt(module.running_var + module.eps))


@register(nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
def instance_norm(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                  out: dict[str, torch.Tensor]) -> None:
    """activation (B, C, *spatial): normalised per sample and channel (its own statistics, as in training mode
    or without running statistics), else with the running statistics (eval mode with track_running_stats)."""
    if module.training or not module.track_running_stats:
        xhat = F.instance_norm(activation, eps=module.eps)  # no running statistics given: none are updated
    else:
        xhat = running_normalised(activation, module)
    per_channel(xhat, grad_output, out)


def running_normalised(activation: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """activation (B, C, *spatial) normalised with the module's running statistics (C,)."""
    view = (1, -1) + (1,) * (activation.dim() - 2)
    return (activation - module.running_mean.view(view)) * torch.rsqrt(module.running_var.view(view) + module.eps)


def per_channel(xhat: torch.Tensor, grad_output: torch.Tensor, out: dict[str, torch.Tensor],
                scale: torch.Tensor | None = None) -> None:
    """Channel-wise affine: xhat (B, C, *spatial), grad_output (N, B, C, *spatial) -> sums per channel (the
    weight's times ``scale`` (C,) where given: xhat then the input before that scaling)."""
    n, batch, channels = grad_output.shape[:3]
    g = grad_output.reshape(n, batch, channels, -1)
    if "weight" in out:
        # the product and its sum: a bmm of B * C rows took 1.1-1.4x as long on ResNet-18's maps, 4x on 1 x 1 and on
        # 32 x 32 ones (2 cores, torch 2.14)
        torch.sum(g * xhat.reshape(batch, channels, -1), dim=-1, out=out["weight"])
        if scale is not None:
            out["weight"].mul_(scale)
    if "bias" in out:
        torch.sum(g, dim=-1, out=out["bias"])
