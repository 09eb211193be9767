"""The outputs a booked backward asks autograd for: those whose graph reaches no other one's, so that the backward
runs through all the others (each seen by its hook) without holding their gradients; remembered per plan for the
same calls, and a check that a remembered choice still fits this call's graph."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pergrad_viz.core.graph import NodeMap, Nodes, children, walk
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.capture import Call


def lowest(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors whose backward graph reaches no other one's: asking autograd for their gradients alone runs the
    backward through all the others (each then seen by its hook) without holding theirs. An iterative walk of the
    graph, each node visited once."""
    nodes = Nodes(t.grad_fn for t in tensors)
    below: NodeMap[bool] = NodeMap()  # per node: whether it is, or leads to, a node of one of the tensors

    def reaches(node) -> bool:
        stack = [node]
        while stack:
            n = stack[-1]
            if n in below:
                stack.pop()
                continue
            below_n = children(n)
            todo = [c for c in below_n if c not in below]
            if todo:
                stack.extend(todo)
                continue
            stack.pop()
            below[n] = n in nodes or any(below[c] for c in below_n)
        return below[node]

    return [t for t in tensors if t.grad_fn is None or not any(reaches(c) for c in children(t.grad_fn))]


def reached(root, nodes: list) -> bool:
    """Whether the backward graph from ``root`` (a grad_fn) reaches any of ``nodes`` (grad_fns; None: a leaf)."""
    wanted = Nodes(nodes)
    return any(node in wanted for node in walk([root]))


class StaleLowest(Exception):
    """The outputs a plan's earlier calls asked autograd for missed one this call's loss reaches (a forward whose
    graph changes with the data): the batch is run again with its own graph walked."""


def asked(trainable: Trainable, calls: list[Call], wanted: list, fresh: bool) -> tuple[list[int], bool]:
    """(the positions in ``wanted`` autograd is asked for, whether they come from the plan's memory): the plan's
    earlier calls' :func:`lowest` for the same calls, else this graph's (remembered for the next calls)."""
    plan = trainable.call.plan
    structure = (tuple(c.key for c in calls), tuple((i, k, t.grad_fn is None) for i, k, t in wanted))
    known = None if plan is None or fresh else plan.lowest.get(structure)
    if known is not None:
        return list(known), True
    ids = {id(t) for t in lowest([t for _, _, t in wanted])}
    positions = [j for j, (_, _, t) in enumerate(wanted) if id(t) in ids]
    if plan is not None:
        plan.remember_lowest(structure, tuple(positions))
    return positions, False
