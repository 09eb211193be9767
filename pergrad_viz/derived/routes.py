"""Which way book-keeping takes a layer whose calls have these shapes: by its ghost norm and weighted sum (a Linear's
norms in one piece, or with the other Linears' after the backward), or by its per-sample gradients where they are
the cheaper (``GhostRule.instantiates``). Decided from the shapes alone, kept in the layer's plan."""

from __future__ import annotations

import enum

import torch

from pergrad_viz.derived.norms import ghost_rule, norm_step
from pergrad_viz.engine.capture import Layer
from pergrad_viz.rules import positions, weighted_sum_rule_for
from pergrad_viz.rules.linear import LinearGhost
from pergrad_viz.rules.linear_batch import batchable


class Form(enum.Enum):
    """How a routed layer's norms are taken."""

    STACKED = "its calls stacked, a few samples at a time (ghost_squared_norms)"
    ONE_LINEAR = "a Linear's one call in one piece (one_linear_call_norms)"
    WITH_OTHERS = "a Linear's Grams with the other Linears' after the backward (linear_gram_norms)"


_UNSEEN = object()  # a route not made yet
ROUTES = 64  # the shapes remembered per layer


def route(layer: Layer, a: torch.Tensor, g: torch.Tensor) -> tuple | None:
    """(ghost rule, weighted-sum rule, :class:`Form`) of an untied layer called once with activation ``a`` (B, ...)
    and output gradient ``g`` (B, ...), booked by its ghost norm and weighted sum; None where its rules are others or
    its per-sample gradients the cheaper. Kept in the layer's plan from the first call of these shapes."""
    key = (layer.kind, a.shape, g.shape, a.dtype, g.dtype, a.device)
    found = layer.plan.memo.get(key, _UNSEEN)
    if found is _UNSEEN:
        if len(layer.plan.memo) >= ROUTES:  # batch sizes change (Poisson sampling): the memo stays small
            layer.plan.memo.clear()
        found = layer.plan.memo[key] = _route(layer, a, g)
    return found


def _route(layer: Layer, a: torch.Tensor, g: torch.Tensor) -> tuple | None:
    rules = booked_rules(layer, [(a, g)], untied=True)
    if rules is None:
        return None
    ghost = rules[0]
    step, direct = norm_step(ghost, layer.module, [(a, g)])
    if direct is not None or step < a.shape[0] or ghost.stack is not LinearGhost.stack:
        return *rules, Form.STACKED
    if with_others(positions(a, a.shape[0]), positions(g, g.shape[0]), layer.local):
        return *rules, Form.WITH_OTHERS
    return *rules, Form.ONE_LINEAR


def with_others(a: torch.Tensor, g: torch.Tensor, roles: dict[str, str]) -> bool:
    """Whether a Linear map's norms (a (B, T, in), g (B, T, out)) are taken with the other Linears' after the
    backward: :func:`~pergrad_viz.rules.linear_batch.batchable`, and its Grams for all B samples within the budget
    that would take them in one piece."""
    return batchable(a, g, roles) and norm_step(LinearGhost, None, [(a, g)])[0] >= a.shape[0]


def booked_rules(layer: Layer, seen_first: list[tuple[torch.Tensor, torch.Tensor]], untied: bool) -> tuple | None:
    """(ghost rule, weighted-sum rule) of a layer booked by them; None where it has none, or where it is ``untied``
    and its per-sample gradients are the cheaper (a ViT's layers on 197 tokens, LoRA adapters)."""
    ghost = ghost_rule(layer)
    rule = weighted_sum_rule_for(layer.module) if ghost is not None else None
    if rule is None:
        return None
    cheaper = getattr(ghost, "instantiates", None)
    if untied and cheaper is not None and cheaper(layer.module, seen_first):
        return None
    return ghost, rule
