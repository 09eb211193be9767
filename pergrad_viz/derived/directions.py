"""A direction's derivative along each sample's gradient, ``g_i . v`` (B,) per parameter, from a layer's captures,
without its per-sample gradients: the per-call check's screen of every row against its sample alone by forward mode,
for the results never built as rows (the ghost norms, book-keeping's clipped sum, the scan's norms). Linear maps
(attention's projections, Hugging Face's Conv1D) as ``sum_t L_t . (V R_t)`` of their ghost factors, an Embedding's
rows gathered at its indices, a convolution (zero padding) by its own operation with the direction as its weight,
``sum g * conv(x, V)``; every other layer from its per-sample gradients (a normalization's (B, D))."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

from pergrad_viz.derived.sums import linear_view_pairs
from pergrad_viz.engine.capture import Layer
from pergrad_viz.engine.grouping import Seen, dense_grads
from pergrad_viz.engine.plan import LayerKind
from pergrad_viz.rules import ghost_rule_for
from pergrad_viz.rules.linear import LinearGhost

_CONVS = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}


@torch.no_grad()
def layer_directions(layer: Layer, seen: Seen, direction: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{full name: (B,) the per-sample gradient of that parameter (this layer's share) dotted with
    ``direction[full name]``} of one layer (``seen``: its calls, N = 1); where a layer cannot form them, none (the
    screen then suspects some row, which the sample-alone check clears: never the user's error)."""
    try:
        return _layer_directions(layer, seen, direction)
    except Exception:
        return {}


def _layer_directions(layer: Layer, seen: Seen, direction: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    module, local = layer.module, layer.local
    ghost = ghost_rule_for(module) if layer.kind is LayerKind.RULE else None
    if ghost is not None and ghost.kind in ("linear", "embedding"):  # all calls as one, the samples first
        a, g = ghost.stack(module, [(call.activation, call.rule_grad(gs[0])) for call, gs in seen])
    if ghost is not None and ghost.kind == "linear":
        return _linear(ghost, module, a, g[0], local, direction)  # a (B, T, in), g (1, B, T, out)
    if ghost is not None and ghost.kind == "embedding":  # a (B, T) indices, g (1, B, T, D), a padding row's zeroed
        return {local["weight"]: (direction[local["weight"]][a] * g[0]).sum((1, 2))} if "weight" in local else {}
    conv = _CONVS.get(type(module)) if layer.kind is LayerKind.RULE else None
    if conv is not None and module.padding_mode == "zeros":
        return _conv(module, conv, seen, local, direction)
    pairs = linear_view_pairs(layer, seen)
    if pairs is not None:
        out: dict[str, torch.Tensor] = {}
        for a, g, roles in pairs:
            out.update(_linear(LinearGhost, None, a, g, roles, direction))
        return out
    return dense_dots({local[ln]: t[0] for ln, t in dense_grads(layer, seen).items()}, direction)


def dense_dots(grads: Mapping[str, torch.Tensor], direction: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{full name: (B,) g_i . v} of per-sample gradients held {full name: (B, *shape)}."""
    with torch.no_grad():
        return {name: g.reshape(g.shape[0], -1) @ direction[name].reshape(-1) for name, g in grads.items()}


def _linear(ghost, module, a: torch.Tensor, g: torch.Tensor, roles: Mapping[str, str],
            direction: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Linear map's, a (B, T, in) and g (B, T, out): its weight's gradient ``sum_t L_t R_t^T`` (the ghost factors,
    in the weight's own layout) dotted with V is ``sum_t L_t . (V R_t)``; its bias's ``sum_t g_t``."""
    out = {}
    if "weight" in roles:
        left, right = ghost.factors(module, a, g)
        out[roles["weight"]] = ((right @ direction[roles["weight"]].mT) * left).sum((1, 2))
    if "bias" in roles:
        out[roles["bias"]] = g.sum(1) @ direction[roles["bias"]]
    return out


def _conv(module: nn.Module, conv, seen: Seen, local: Mapping[str, str],
          direction: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A convolution's, summed over its calls: ``sum g * conv(x, V)`` for the weight, ``sum g`` per channel . b."""
    out: dict[str, torch.Tensor] = {}
    for call, gs in seen:
        x, g = call.activation, call.rule_grad(gs[0])[0]  # (B, C_in, ...), (B, C_out, ...)
        parts = {}
        if "weight" in local:
            moved = conv(x, direction[local["weight"]], None, module.stride, module.padding, module.dilation,
                         module.groups)
            parts[local["weight"]] = (moved * g).flatten(1).sum(1)
        if "bias" in local:
            parts[local["bias"]] = g.flatten(2).sum(2) @ direction[local["bias"]]
        for name, t in parts.items():
            out[name] = t if name not in out else out[name] + t
    return out
