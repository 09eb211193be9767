"""The flat layout of per-sample results: which columns of a (..., P) tensor (``per_sample_grads(...,
flat=True)`` is (B, P), ``per_sample_jacobian(..., flat=True)`` (B, Y, P)) belong to which parameter."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from pergrad_viz.errors import HandOverError


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


def sample_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (B, *shape) as (B, n), n = prod(shape) the numbers of one sample (1 for shape (), also 0, where
    ``reshape(B, -1)`` is ambiguous: a zero-width layer's gradient)."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))


def flat_outputs(output: torch.Tensor, batch: int) -> torch.Tensor:
    """(B, *out) -> (B, Y) with Y = prod(out); :class:`~pergrad_viz.errors.HandOverError` where ``output`` (what
    ``output=`` selected from a batched forward) does not hold the ``batch`` samples first (``o.sum()``: 0-dim)."""
    if output.dim() == 0 or output.shape[0] != batch:
        raise HandOverError(
            f"the output to differentiate has shape {tuple(output.shape)} on a batch of {batch}: a strategy that runs "
            "the batch at once needs the samples first, (B, ...), to split it (an output= that reduces over the "
            "batch, such as o.sum(), gives no such tensor). Use strategy='auto' or 'loop', which apply output= to "
            "each sample alone", reason=f"the output to differentiate has shape {tuple(output.shape)}")
    return output.reshape(batch, -1)


def flat_views(flat: torch.Tensor, shapes: Mapping[str, torch.Size], lead: tuple[int, ...]
               ) -> dict[str, torch.Tensor]:
    """``{name: (*lead, *shape)}`` views of each parameter's columns of a flat ``(*lead, P)`` tensor, in the order
    of ``shapes`` (:func:`param_boundaries`); writing into a view writes into ``flat``."""
    return {name: flat[..., start:stop].view(*lead, *shapes[name]) for name, start, stop in param_boundaries(shapes)}
