"""timm layers: its ``LayerNorm`` (nn.LayerNorm with a forward of its own), ``LayerNorm2d`` (LayerNorm over the
channels of (B, C, H, W)), ``BatchNormAct2d`` in eval mode (BatchNorm on running statistics, then dropout and an
activation), ``LayerScale`` / ``LayerScale2d`` (a learned per-channel scale) and ``ConvNeXtBlock``'s own layer scale
``gamma``. Registered by class path, each with
a verbatim copy of the timm 1.0 forward it was written for (``forward_like``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pergrad_viz.rules.normalization import layer_norm, layer_normalised, per_channel, running_normalised
from pergrad_viz.rules.registry import register

PATHS = ("timm.layers.norm.LayerNorm", "timm.layers.norm.LayerNorm2d", "timm.layers.norm_act.BatchNormAct2d",
         "timm.layers.layer_scale.LayerScale", "timm.layers.layer_scale.LayerScale2d",
         "timm.models.convnext.ConvNeXtBlock")

# ------------------------------------------------------------------------------------------------------ LayerNorm


def _layer_norm_forward(self, x: torch.Tensor) -> torch.Tensor:  # timm.layers.norm.LayerNorm.forward, verbatim
    if self._fast_norm:
        x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # noqa: F821
    else:
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
    return x


def _layer_norm_2d_forward(self, x: torch.Tensor) -> torch.Tensor:  # timm.layers.norm.LayerNorm2d.forward
    x = x.permute(0, 2, 3, 1)
    if self._fast_norm:
        x = fast_layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)  # noqa: F821
    else:
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
    x = x.permute(0, 3, 1, 2)
    return x


def _plain_norm(module: nn.Module) -> bool:
    """timm's fast norm (APEX, or autocast to a lower precision) computes differently: left to the fallback."""
    return not module._fast_norm


@register("timm.layers.norm.LayerNorm", features=lambda module: len(module.normalized_shape), supports=_plain_norm,
          forward_like=_layer_norm_forward)
def timm_layer_norm(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                    out: dict[str, torch.Tensor]) -> None:
    layer_norm(module, activation, grad_output, out)


@register("timm.layers.norm.LayerNorm2d", supports=_plain_norm, forward_like=_layer_norm_2d_forward)
def layer_norm_2d(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                  out: dict[str, torch.Tensor]) -> None:
    """activation (B, C, H, W) normalised over C at each position; grad_output (N, B, C, H, W)."""
    xhat = layer_normalised(activation.permute(0, 2, 3, 1), torch.Size(module.normalized_shape), module.eps)
    per_channel(xhat.permute(0, 3, 1, 2), grad_output, out)


# ------------------------------------------------------------------------------------------------- BatchNormAct2d


def _batch_norm_act_forward(self, x):  # timm.layers.norm_act.BatchNormAct2d.forward, verbatim (comments left out)
    _assert(x.ndim == 4, f'expected 4D input (got {x.ndim}D input)')  # noqa: F821
    if self.momentum is None:
        exponential_average_factor = 0.0
    else:
        exponential_average_factor = self.momentum
    if self.training and self.track_running_stats:
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
            else:
                exponential_average_factor = self.momentum
    r"""
        Decide whether the mini-batch stats should be used for normalization rather than the buffers.
        Mini-batch stats are used in training mode, and in eval mode when buffers are None.
        """
    if self.training:
        bn_training = True
    else:
        bn_training = (self.running_mean is None) and (self.running_var is None)
    r"""
        Buffers are only updated if they are to be tracked and we are in training mode. Thus they only need to be
        passed when the update should occur (i.e. in training mode when they are tracked), or when buffer stats are
        used for normalization (i.e. in eval mode when buffers are not None).
        """
    x = F.batch_norm(
        x,
        self.running_mean if not self.training or self.track_running_stats else None,
        self.running_var if not self.training or self.track_running_stats else None,
        self.weight,
        self.bias,
        bn_training,
        exponential_average_factor,
        self.eps,
    )
    x = self.drop(x)
    x = self.act(x)
    return x


def _running_stats(module: nn.Module) -> bool:
    """Eval mode with running statistics (in training mode, or without them, the api refuses BatchNorm anyway)."""
    return not module.training and module.running_mean is not None and module.running_var is not None


@register("timm.layers.norm_act.BatchNormAct2d", supports=_running_stats, forward_like=_batch_norm_act_forward)
def batch_norm_act_2d(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                      out: dict[str, torch.Tensor]) -> None:
    """act(drop(w * xhat + b)): the gradient before the activation is its vector-Jacobian product at w * xhat + b,
    recomputed from the input (B, C, H, W) (one extra pass of the activation); grad_output (N, B, C, H, W)."""
    xhat = running_normalised(activation, module)
    with torch.enable_grad():
        pre = F.batch_norm(activation, module.running_mean, module.running_var, module.weight, module.bias, False,
                           0.0, module.eps).detach().requires_grad_()
        post = module.act(module.drop(pre * 1))  # `* 1`: an in-place activation must not write into the leaf
        if grad_output.shape[0] == 1 or torch.is_anomaly_enabled():  # anomaly mode: no batching rule
            g = torch.stack([torch.autograd.grad(post, pre, row, retain_graph=True)[0] for row in grad_output])
        else:
            g = torch.autograd.grad(post, pre, grad_output, is_grads_batched=True)[0]
    per_channel(xhat, g, out)


# ------------------------------------------------------------------------------------------------------ LayerScale


def _layer_scale_forward(self, x: torch.Tensor) -> torch.Tensor:  # timm.layers.layer_scale.LayerScale.forward
    return x.mul_(self.gamma) if self.inplace else x * self.gamma


def _layer_scale_2d_forward(self, x):  # timm.layers.layer_scale.LayerScale2d.forward, verbatim
    gamma = self.gamma.view(1, -1, 1, 1)
    return x.mul_(gamma) if self.inplace else x * gamma


def _not_in_place(module: nn.Module) -> bool:
    """``inplace=True`` overwrites the layer's input, which the rule needs: left to the fallback."""
    return not module.inplace


@register("timm.layers.layer_scale.LayerScale", features=lambda module: 1, supports=_not_in_place,
          forward_like=_layer_scale_forward)
def layer_scale(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                out: dict[str, torch.Tensor]) -> None:
    """x * gamma, gamma (d,) on the last dimension: activation (B, ..., d), grad_output (N, B, ..., d)."""
    if "gamma" in out:
        n, batch = grad_output.shape[:2]
        d = activation.shape[-1]
        prod = grad_output.reshape(n, batch, -1, d) * activation.reshape(batch, -1, d)
        torch.sum(prod, dim=2, out=out["gamma"])


@register("timm.layers.layer_scale.LayerScale2d", supports=_not_in_place, forward_like=_layer_scale_2d_forward)
def layer_scale_2d(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                   out: dict[str, torch.Tensor]) -> None:
    """x * gamma, gamma (C,) on dimension 1: activation (B, C, ...), grad_output (N, B, C, ...)."""
    per_channel(activation, grad_output, {"weight": out["gamma"]} if "gamma" in out else {})


# --------------------------------------------------------------------------------------------------- ConvNeXtBlock


def _convnext_block_forward(self, x: torch.Tensor) -> torch.Tensor:  # timm.models.convnext.ConvNeXtBlock.forward
    """Forward pass."""
    shortcut = x
    x = self.conv_dw(x)
    if self.use_conv_mlp:
        x = self.norm(x)
        x = self.mlp(x)
    else:
        x = x.permute(0, 2, 3, 1)
        x = self.norm(x)
        x = self.mlp(x)
        x = x.permute(0, 3, 1, 2)
    if self.gamma is not None:
        x = x.mul(self.gamma.reshape(1, -1, 1, 1))

    x = self.drop_path(x) + self.shortcut(shortcut)
    return x


def _identity_path(module: nn.Module) -> bool:
    """The block's own parameter is its layer scale ``gamma``; the rule needs drop_path to pass x through (an
    ``nn.Identity``, or ``DropPath`` in eval mode: random in training, which the probe refuses anyway)."""
    return module.gamma is not None and (isinstance(module.drop_path, nn.Identity) or not module.drop_path.training)


@register("timm.models.convnext.ConvNeXtBlock", supports=_identity_path, forward_like=_convnext_block_forward)
def convnext_block(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                   out: dict[str, torch.Tensor]) -> None:
    """The block's layer scale: output = shortcut(x) + mlp(x) * gamma (per channel), so sample b's gradient of gamma
    sums grad_output * mlp(x) over the positions. activation (B, C_in, H, W), grad_output (N, B, C, H', W'); mlp(x)
    is recomputed from the block's own layers, without gradients (one forward of the block's body, no backward);
    the block's children keep their own rules."""
    if "gamma" not in out:
        return
    with torch.no_grad():
        x = module.conv_dw(activation)
        if module.use_conv_mlp:
            x = module.mlp(module.norm(x))
        else:
            x = module.mlp(module.norm(x.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
    per_channel(x, grad_output, {"weight": out["gamma"]})
