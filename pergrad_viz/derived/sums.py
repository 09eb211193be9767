"""The clipped sum's tensors, {name: (*shape)}: made as the layers' shares ask for them (noise drawn in parameter
order all the same), and without noise handed out unwritten to a writer that fills them
(``pergrad_viz.rules.register_weighted_sum(..., writes_fresh=True)``)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping

import torch

from pergrad_viz.core.layout import sample_rows
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.capture import Layer
from pergrad_viz.engine.grouping import Seen, dense_grads
from pergrad_viz.engine.plan import LayerKind
from pergrad_viz.rules import ghost_rule_for, linear_views_for, positions, weighted_sum_rule_for, writes_fresh
from pergrad_viz.rules.linear import linear_weighted_sum


class LazySums(dict):
    """{name: (*shape)}: the tensors the clipped gradients are added into, each made when first asked for: ``std *
    N(0, I)`` drawn in place (``normal_``, from ``generator`` alone, always in parameter order: asking for a later
    parameter draws the earlier ones first, so the draws are the same whatever order the layers ask in), or zeros
    for ``std=0``. The layers' shares come bottom layer first, as a backward has let their activations go, so the
    sums are not all held beside every layer's captures (as plain training's ``.grad`` is made during its
    backward); without noise, :meth:`destination` hands a tensor out unwritten to a writer that fills it."""

    def __init__(self, shapes, std: float, generator: torch.Generator | None):
        super().__init__()
        self._shapes = {name: rest for name, *rest in shapes}  # name -> (shape, dtype, device), in order
        self._todo = collections.deque(self._shapes)  # the names whose noise is not drawn yet, in order
        self._std, self._generator = std, generator

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        if self._std == 0:
            shape, dtype, device = self._shapes[name]
            t = self[name] = torch.zeros(shape, dtype=dtype, device=device)
            return t
        while self._todo:
            made = self._todo.popleft()
            shape, dtype, device = self._shapes[made]
            self[made] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, self._std,
                                                                                 generator=self._generator)
            if made == name:
                break
        return self[name]

    def destination(self, name: str) -> tuple[torch.Tensor, bool]:
        """(the tensor of ``name``, whether it is handed out unwritten): without noise, the first time a name is
        asked for here its tensor is allocated and not zeroed, and the caller must write all of it before it is
        read (``addmm_(..., beta=0)``, ``copy_``); every other time it holds values, to be added to."""
        if self._std == 0 and name not in self and name in self._shapes:
            shape, dtype, device = self._shapes[name]
            t = self[name] = torch.empty(shape, dtype=dtype, device=device)
            return t, True
        return self[name], False

    def add_weighted(self, name: str, g: torch.Tensor, c: torch.Tensor) -> None:
        """self[name] (*shape) += sum_i c_i g_i of a (B, *shape) per-sample gradient and c (B,), one ``addmm_`` into
        it (written, not added, where :meth:`destination` hands it out unwritten), in the sum's dtype (a model of
        several dtypes: the per-sample gradients come in one)."""
        dest, fresh = self.destination(name)
        dest.view(1, -1).addmm_(c.to(dest.dtype).unsqueeze(0), sample_rows(g).to(dest.dtype),
                                beta=0 if fresh else 1)

    def add_share(self, rule: Callable, module, seen, weights: dict[str, torch.Tensor],
                  names: Mapping[str, str]) -> None:
        """A weighted-sum rule's share added in (``names``: the rule's local names' full ones): the tensors
        :meth:`destination` hands out unwritten are the rule's to write (``pergrad_viz.rules.writes_fresh``), or
        zeroed first for a rule that only adds."""
        out, fresh = {}, []
        for ln, name in names.items():
            out[ln], new = self.destination(name)
            if new:
                fresh.append(ln)
        if writes_fresh(rule):
            rule(module, seen, weights, out, fresh)
            return
        for ln in fresh:
            out[ln].zero_()
        rule(module, seen, weights, out)

    def complete(self) -> dict[str, torch.Tensor]:
        """Every parameter's tensor made; a plain dict in parameter order."""
        return {name: self[name] for name in self._shapes}


def zero_sums(trainable: Trainable) -> LazySums:
    """:class:`LazySums` of every trainable parameter without noise (zeros where nothing is added)."""
    return LazySums([(n, p.shape, p.dtype, p.device) for n, p in zip(trainable.names, trainable.params, strict=True)],
                    0.0, None)


def initial_sums(shapes, std: float, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """{name: (*shape)}: every tensor of :class:`LazySums` made at once (noise drawn parameter by parameter in
    order, or zeros); the clipped gradients are then added into these (no temporary)."""
    return LazySums(shapes, std, generator).complete()


def linear_view_pairs(layer: Layer, seen: Seen) -> list[tuple[torch.Tensor, torch.Tensor, dict[str, str]]] | None:
    """A call layer made of Linear maps (``register_linear_views``: attention's projections), called once (``seen``:
    N = 1): [(a (B, T, in), g (B, T, out), {"weight" / "bias": full name})] of its trainable maps; None where it has
    no such rule, or a parameter outside its maps (``bias_k``, ``bias_v``)."""
    views_rule = linear_views_for(layer.module) if layer.kind is LayerKind.CALL else None
    if views_rule is None or len(seen) != 1:
        return None
    call, gs = seen[0]
    outputs = len(call.outputs)
    views = views_rule(layer.module, call.inputs, gs[:outputs], call.captured, gs[outputs:])
    if views is None:
        return None
    local = layer.local
    pairs = []
    for a, g, names in views:
        full = {role: local[ln] for role, ln in names.items() if ln in local}
        if full:
            pairs.append((positions(a, a.shape[0]), positions(g, g.shape[0]), full))
    if {n for *_, full in pairs for n in full.values()} != set(local.values()):
        return None
    return pairs


@torch.no_grad()
def add_layer(sums: LazySums, layer: Layer, seen: Seen, weights: torch.Tensor) -> None:
    """``sums += sum_i w_i g_i`` of one layer's per-sample gradients (``seen``: its calls, N = 1; ``weights`` (B,)):
    by its weighted-sum rule or its Linear maps where it has them (never its (B, *shape) gradients), else from its
    per-sample gradients."""
    ghost = ghost_rule_for(layer.module) if layer.kind is LayerKind.RULE else None
    rule = weighted_sum_rule_for(layer.module) if ghost is not None else None
    if rule is not None:
        seen_first = [(call.activation, call.rule_grad(gs[0])[0]) for call, gs in seen]
        sums.add_share(rule, layer.module, seen_first, dict.fromkeys(layer.local, weights), layer.local)
        return
    pairs = linear_view_pairs(layer, seen)
    if pairs is not None:
        for a, g, full in pairs:
            sums.add_share(linear_weighted_sum, None, [(a, g)], dict.fromkeys(full, weights), full)
        return
    for ln, g in dense_grads(layer, seen).items():
        sums.add_weighted(layer.local[ln], g[0], weights)
