"""Parameters used where the plan does not see them, refused per call (:class:`~pergrad_viz.errors.PlanMismatchError`,
a hand-over under ``auto``) instead of given wrong rows: a parameter no layer of the plan handles (the probe saw no
forward use it), whose gradient a backward asks for too; and a planned parameter that the loss reaches other than
through its layer's calls (a branch the data switches on, :func:`refuse_outside_uses`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pergrad_viz.core.graph import NodeMap, Nodes
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.volatile import forget
from pergrad_viz.errors import USE_AUTO, PlanMismatchError

if TYPE_CHECKING:
    from pergrad_viz.engine.capture import Call


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
                "the per-layer rules cannot be trusted. " + USE_AUTO
            )


def refuse_outside_uses(trainable: Trainable, calls: list[Call], roots: list) -> None:
    """:class:`~pergrad_viz.errors.PlanMismatchError` where the backward graph from ``roots`` (the loss's or the
    outputs' grad_fns) reaches a trainable parameter that a layer of the plan handles other than through that
    layer's calls: the walk takes the graph between the layers only, each captured call entered at its outputs
    and left at its arguments (its inside, where its own parameters are, never walked). Such a use (``h +
    x @ layer.weight.T`` on the batches that take a branch, after the probe and the earlier calls took the other)
    puts a part in the parameter's gradient that the layer's rule, which sees only its outputs' gradients, would
    miss on every row. Each node between the layers is visited once (no tensor is read); the kinds of node met, in
    order, are the call's graph between the layers (``trainable.call.graphs``: one not seen before makes the call's
    check due, :func:`~pergrad_viz.engine.schedule.unseen_graphs`: a coupling of the samples switched on since)."""
    planned = trainable.call.plan.planned
    params = {id(p): name for name, p in zip(trainable.names, trainable.params, strict=True) if name in planned}
    entries: NodeMap[tuple] = NodeMap()  # a call's output node -> (its key, its arguments' nodes)
    for call in calls:
        for t in (*call.outputs, *call.internals):
            if t.grad_fn is not None:
                entries[t.grad_fn] = (call.key, call.input_nodes)
    seen, kinds = Nodes(), []
    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node in entries:
            key, below = entries[node]
            kinds.append(key)
            stack.extend(below)
            continue
        kinds.append(type(node))
        below = node.next_functions
        if below:
            stack.extend(child for child, _ in below)
            continue
        name = params.get(id(getattr(node, "variable", None)))
        if name is not None:
            forget(trainable.model)
            raise PlanMismatchError(
                f"trainable parameter '{name}' takes part in this call outside the forward of the layer that holds "
                "it (a branch the data or a flag switches on since the probe, e.g. `h + x @ layer.weight.T` on some "
                "batches only), so its per-layer rule would miss that part of every sample's gradient. " + USE_AUTO
            )
    trainable.call.graphs.add(hash(tuple(kinds)))
