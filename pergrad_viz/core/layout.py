"""The flat layout of per-sample results: which columns of a (..., P) tensor (``per_sample_grads(...,
flat=True)`` is (B, P), ``per_sample_jacobian(..., flat=True)`` (B, Y, P)) belong to which parameter."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch


def param_boundaries(model_or_named_shapes: Any, *, lead: int = 0) -> list[tuple[str, int, int]]:
    """``[(name, start, stop), ...]``: each trainable parameter's columns in a flat (..., P) result.

    Args:
        model_or_named_shapes: an ``nn.Module`` (its parameters with ``requires_grad``, in
            ``named_parameters()`` order: the layout of ``per_sample_grads(..., flat=True)``), or a mapping
            / iterable of ``(name, shape or tensor)`` in flat order.
        lead: leading dimensions to ignore in the given shapes, e.g. ``lead=1`` for a per-sample gradient
            dict ``{name: (B, *param.shape)}``, ``lead=2`` for a Jacobian dict ``{name: (B, Y, *shape)}``.
    """
    if hasattr(model_or_named_shapes, "named_parameters"):
        named = [(n, p.shape) for n, p in model_or_named_shapes.named_parameters() if p.requires_grad]
    else:
        items = model_or_named_shapes.items() if isinstance(model_or_named_shapes, Mapping) else model_or_named_shapes
        named = [(n, getattr(s, "shape", s)) for n, s in items]
    out, start = [], 0
    for name, shape in named:
        n = math.prod(tuple(shape)[lead:])
        out.append((name, start, start + n))
        start += n
    return out


def flat_outputs(output: torch.Tensor) -> torch.Tensor:
    """(B, *out) -> (B, Y) with Y = prod(out)."""
    return output.reshape(output.shape[0], -1)


def flat_views(flat: torch.Tensor, shapes: Mapping[str, torch.Size], lead: tuple[int, ...]
               ) -> dict[str, torch.Tensor]:
    """``{name: (*lead, *shape)}`` views of each parameter's columns of a flat ``(*lead, P)`` tensor, in the order
    of ``shapes`` (:func:`param_boundaries`); writing into a view writes into ``flat``."""
    return {name: flat[..., start:stop].view(*lead, *shapes[name]) for name, start, stop in param_boundaries(shapes)}
