"""Parameters no layer of the plan handles (the probe saw no forward use them): a backward asks for their gradients
too, so that a forward which uses one now is refused (:class:`~pergrad_viz.errors.PlanMismatchError`, a hand-over
under ``auto``) instead of giving it zeros."""

from __future__ import annotations

import torch

from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.volatile import forget
from pergrad_viz.errors import PlanMismatchError


def unplanned(trainable: Trainable) -> tuple[list[str], list[torch.Tensor]]:
    """(names, tensors) of the trainable parameters no layer of this call's plan handles: the probe saw no forward
    use them. A backward asks for their gradients too (none is computed where none reaches them: no cost), so that
    one used now, by a forward switched by what the plan's key does not read (a global flag, a setting in an
    object outside the model), is seen instead of given zeros."""
    planned = trainable.call.plan.planned
    names, params = [], []
    for name, p in zip(trainable.names, trainable.params, strict=True):
        if name not in planned:
            names.append(name)
            params.append(p)
    return names, params


def refuse_unplanned(trainable: Trainable, names: list[str], grads) -> None:
    """:class:`~pergrad_viz.errors.PlanMismatchError` where a parameter of ``names`` got a gradient (the numbers left
    out of the model's plan key then count again, :func:`~pergrad_viz.engine.volatile.forget`)."""
    for name, g in zip(names, grads, strict=True):
        if g is not None:
            forget(trainable.model)
            raise PlanMismatchError(
                f"trainable parameter '{name}' takes part in this call, but the probe of this model saw no layer use "
                "it: a use the probe cannot follow (inside torch.vmap or another transform in the forward), or a "
                "forward switched since by what the plan cannot see (a global flag, an object outside the model), so "
                "the per-layer rules cannot be trusted. Use strategy='torch_func' (or 'auto', which switches to it)."
            )
