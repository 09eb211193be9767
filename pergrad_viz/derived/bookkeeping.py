"""The clipped sum of DP-SGD by book-keeping (Bu et al., ICML 2023): one hooked forward, one backward to the layer
outputs, then per layer the ghost norm and, once every sample's clip factor c_i is known, ``sum_i c_i g_i`` from
the same captured inputs and output gradients (a Linear: ``(c G)^T A``, one matmul over the B * T rows).

Shapes: B samples, K clipping groups (one for flat clipping), ``*shape`` a parameter's shape.

Memory: each layer is booked as soon as the backward has given all its output gradients (a tensor hook on each
layer output; autograd is asked only for the outputs below which no other layer lies, so that it holds no other
gradient): its norms are taken then, and only what its share of the sum needs is kept, (a, g) for a layer with a
weighted-sum rule (``pergrad_viz.rules.register_weighted_sum``), its per-sample gradients (B, *shape) for the others
(a LayerNorm's (B, D)) and for a layer whose norm would form them anyway while they hold no more numbers than its
(a, g) (``GhostRule.instantiates``: a ViT's Linears on 197 tokens, LoRA adapters, an RGB stem), which are then
added in with one ``addmm_`` instead of the share's T-fold product; its outputs, output gradients and a
convolution's columns are let go, as plain training lets them go. A layer's stacked form (a convolution's columns)
is built a few samples at a time.

A weight tied between layers (GPT-2's embedding and output layer) keeps each layer's own form: its squared norm is
the sum of the layers' own plus twice their cross inner products (:func:`pergrad_viz.derived.tied.
tied_squared_norms`), its weighted sum the sum of the layers' shares. A layer without a weighted-sum rule gets its
own per-sample gradients from its rule or the per-layer fallback (that layer only, never the whole model). Where
the hooks strategy cannot run, :func:`materialised_sums` builds the per-sample gradients with
:func:`pergrad_viz.per_sample_grads` one chunk at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.core.guards import check_reached, check_takes_part, refusing_reentrant_checkpoints
from pergrad_viz.core.loss_reads import loss_of_output
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.numbers import SQUARES
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.derived.checked_pass import CheckedPass
from pergrad_viz.derived.clipping import Groups, check_finite, clip_factors
from pergrad_viz.derived.directions import dense_dots, layer_directions
from pergrad_viz.derived.norms import ghost_squared_norms, materialised_chunks, one_linear_call_norms, row_squared_norms
from pergrad_viz.derived.routes import Form, booked_rules, route, with_others
from pergrad_viz.derived.sums import LazySums, linear_view_pairs
from pergrad_viz.derived.tied import TiedPart, dense_part, tied_squared_norms
from pergrad_viz.engine.capture import Call, Layer, capture, shape_only
from pergrad_viz.engine.grouping import Seen, dense_grads, tied_names
from pergrad_viz.engine.lowest import StaleLowest, asked, reached
from pergrad_viz.engine.plan import LayerKind
from pergrad_viz.engine.unplanned import refuse_outside_uses, refuse_unplanned, unplanned
from pergrad_viz.rules import Captured, positions
from pergrad_viz.rules.doubts import Doubts, doubts_for
from pergrad_viz.rules.linear import LinearGhost, linear_weighted_sum
from pergrad_viz.rules.linear_batch import LinearCall, linear_gram_norms

# One layer's share of the clipped sum once the clip factors {full name: (B,)} are known, added into the sums
# {full name: (*shape)} (its ``destination(name)`` may hand a tensor out unwritten).
SumOf = Callable[[Mapping[str, torch.Tensor], LazySums], None]


class _Book:
    """What one chunk of samples leaves for its clipped sum, filled layer by layer during the backward: squared
    norms {full name: (B,)}, the shares formed from captures, the per-sample gradients [(full name, (B, *shape))] of
    the other layers, and the parts of each tied weight's norm."""

    def __init__(self, tied: set[str], doubts: Doubts | None = None, direction: dict | None = None):
        self.tied, self.direction = tied, direction  # a checked call's: each row's g_i . v into dots (directions.py)
        self.dots: dict[str, torch.Tensor] = {}
        self.doubts = doubts  # on a GPU: the layers' norms unscaled, their range read once in finish()
        self.squared: dict[str, torch.Tensor] = {}
        self.shares: list[SumOf] = []
        self.dense: list[tuple[str, torch.Tensor]] = []
        self.parts: dict[str, list[TiedPart]] = {}
        self.later: list[tuple[Layer, Seen]] = []  # layers whose rules replay them (torch.func): after the backward
        self.linears: list[LinearCall] = []  # Linear calls whose Gram norms are taken together after the backward

    def add(self, layer: Layer, arrived: Seen, now: bool = True) -> None:
        """Book one layer whose output gradients are all known (``now``: during the backward); ``arrived``: per call,
        its output gradients as autograd gave them (no N dimension; None where none arrived)."""
        entry = self._ghost(layer, arrived)
        if entry is None and now and layer.kind is not LayerKind.RULE and layer.kind is not LayerKind.CALL:
            self.later.append((layer, arrived))
            return
        seen = _with_n(arrived) if entry is None else None
        if entry is None and self.tied.isdisjoint(layer.local.values()):
            entry = _call_layer(layer, seen, self)
        if entry is not None:
            self.squared.update(entry[0])
            self.shares.append(entry[1])
        elif now and layer.kind is not LayerKind.RULE:
            self.later.append((layer, arrived))
            return
        else:
            grads = {layer.local[ln]: g[0] for ln, g in dense_grads(layer, seen).items()}
            for name, g in grads.items():
                own = row_squared_norms(g)
                if name in self.tied:
                    self.parts.setdefault(name, []).append(dense_part(g, own))
                else:
                    self.squared[name] = own
                self.dense.append((name, g))
            self._add_dots(lambda: dense_dots(grads, self.direction))
            return
        self._add_dots(lambda: layer_directions(layer, _with_n(arrived), self.direction))

    def _add_dots(self, dots: Callable[[], dict[str, torch.Tensor]]) -> None:
        """A checked call's (a ``direction``): this layer's share of each row's g_i . v, ``dots()``, added in."""
        if self.direction is not None:
            for name, d in dots().items():
                self.dots[name] = d if name not in self.dots else self.dots[name] + d

    def finish(self) -> None:
        """The layers left for after the backward, the unscaled norms' range read (a layer with extreme values
        computed again), then the tied weights' norms from their parts."""
        if self.doubts is not None:
            self.doubts.settle()
        self.squared.update(linear_gram_norms(self.linears))
        self.linears = []
        for layer, seen in self.later:
            self.add(layer, seen, now=False)
        self.later = []
        for name, parts in self.parts.items():
            self.squared[name] = tied_squared_norms(parts)

    def _norms(self, compute: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """{full name: (B,) squared norm} from ``compute()``: on a GPU (``doubts``) with the Grams unscaled, their range
        read in :meth:`finish`, where a layer with extreme values is computed again (scaled) into ``squared``."""
        if self.doubts is None:
            return compute()
        with self.doubts.layer(lambda: self.squared.update(compute())):
            return compute()

    def _ghost(self, layer: Layer, seen: Seen) -> tuple[dict[str, torch.Tensor], SumOf] | None:
        """A layer with a weighted-sum rule: ({full name: (B,) squared norm} of its untied parameters, its share),
        its tied weights' parts noted; else None."""
        if layer.kind is not LayerKind.RULE:  # no ghost rule (a call layer's views are booked by _call_layer)
            return None
        if len(seen) == 1 and self.doubts is None and self.tied.isdisjoint(layer.local.values()):
            return self._routed(layer, seen[0])
        module, local = layer.module, layer.local
        seen_first = [(call.activation, call.sample_grad(gs[0])) for call, gs in seen]
        rules = booked_rules(layer, seen_first, self.tied.isdisjoint(local.values()))
        if rules is None:
            return None
        ghost, rule = rules
        if self.tied.isdisjoint(local.values()):
            full = self._norms(lambda: {local[ln]: sq for ln, sq in ghost_squared_norms(ghost, module, seen_first,
                                                                                        local).items()})
            own = {ln: full[n] for ln, n in local.items() if n in full}
        else:  # a tied weight's parts are summed in finish(): computed now, scaled where need be
            own = ghost_squared_norms(ghost, module, seen_first, local)
        squared = {}
        for ln, sq in own.items():
            name = local[ln]
            if name not in self.tied:
                squared[name] = sq
                continue
            a, g = ghost.stack(module, [(a, g[None]) for a, g in seen_first])
            factors = ghost.factors(module, a, g[0]) if ln == "weight" else None
            if factors is None:  # this layer's per-sample gradient of the weight, as a part
                part = dense_part(dense_grads(layer, _with_n(seen))[ln][0], sq)
            else:
                part = (*factors, sq)
            self.parts.setdefault(name, []).append(part)

        def share(factors: Mapping[str, torch.Tensor], sums: LazySums) -> None:
            sums.add_share(rule, module, seen_first, {ln: factors[n] for ln, n in local.items()}, local)

        return squared, share

    def _routed(self, layer: Layer, arrived: tuple) -> tuple[dict[str, torch.Tensor], SumOf] | None:
        """:meth:`_ghost` of an untied layer called once, on a CPU, the way :func:`~pergrad_viz.derived.routes.route`
        decides from the call's shapes."""
        call, gs = arrived
        a, g = call.activation, call.sample_grad(gs[0])
        found = route(layer, a, g)
        if found is None:
            return None
        ghost, rule, form = found
        module, local = layer.module, layer.local
        if form is Form.WITH_OTHERS:  # its norms taken in finish(), with the other Linears'
            self.linears.append((positions(a, a.shape[0]), positions(g, g.shape[0]), local))
            own = {}
        elif form is Form.ONE_LINEAR:
            own = one_linear_call_norms(ghost, module, a, g, local)
        else:
            own = ghost_squared_norms(ghost, module, [(a, g)], local)
        squared = {local[ln]: sq for ln, sq in own.items()}

        def share(factors: Mapping[str, torch.Tensor], sums: LazySums) -> None:
            sums.add_share(rule, module, [(a, g)], {ln: factors[n] for ln, n in local.items()}, local)

        return squared, share


def _with_n(arrived: Seen) -> Seen:
    """Each call's output gradients as the rules take them, (N = 1, *output.shape)."""
    return [(call, [None if g is None else g.unsqueeze(0) for g in gs]) for call, gs in arrived]


def _call_layer(layer: Layer, seen: Seen, book: _Book) -> tuple[dict[str, torch.Tensor], SumOf] | None:
    """A call layer made of Linear maps (``register_linear_views``), called once: each map's ghost norm (through
    :meth:`_Book._norms`, or on a CPU with the other Linears') and book-keeping; None where the layer's rule must
    give its per-sample gradients."""
    pairs = linear_view_pairs(layer, seen)
    if pairs is None:
        return None
    squared = {}
    for a, g, full in pairs:
        if book.doubts is None and with_others(a, g, full):
            book.linears.append((a, g, full))  # taken in finish()
            continue
        squared.update(book._norms(lambda a=a, g=g, full=full: {full[role]: sq for role, sq in ghost_squared_norms(
            LinearGhost, None, [(a, g)], full).items()}))

    def share(factors: Mapping[str, torch.Tensor], sums: LazySums) -> None:
        for a, g, full in pairs:
            sums.add_share(linear_weighted_sum, None, [(a, g)], {r: factors[n] for r, n in full.items()}, full)

    return squared, share


def _booked_backward(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object, fresh: bool,
                     direction: dict | None = None) -> _Book:
    """1 forward with hooks, 1 backward of the summed per-sample losses, each layer booked as its output gradients
    (N = 1 first) arrive; the captured outputs kept as shapes only. Autograd is asked for the outputs the plan's
    earlier calls found lowest (unless ``fresh``); where an output's gradient then never arrives although the loss
    reaches it, :class:`~pergrad_viz.engine.lowest.StaleLowest` is raised."""
    output, calls = capture(trainable, inputs)
    check_reached(trainable, calls)  # a merged adapter, a forward under no_grad: refused, as per_sample_grads does
    book = _Book(tied_names(calls), doubts_for(trainable.device), direction)
    wanted = [(i, k, t) for i, c in enumerate(calls) for k, t in enumerate((*c.outputs, *c.internals))
              if t.requires_grad]  # not empty: check_reached refused that
    layers: dict[int, tuple[Layer, list[int]]] = {}
    for i, c in enumerate(calls):
        layers.setdefault(id(c.layer.module), (c.layer, []))[1].append(i)
    waiting = dict.fromkeys(layers, 0)
    for i, _, _ in wanted:
        waiting[id(calls[i].layer.module)] += 1
    pending: list[list | None] = [[None] * (len(c.outputs) + len(c.internals)) for c in calls]
    records: list[Call | None] = [Call(c.layer, c.inputs, c.input_tensors, [shape_only(t) for t in c.outputs], c.spec,
                                       c.versions, None if c.captured is None else Captured(
                                           [shape_only(t) for t in c.captured.internals], c.captured.state), c.key)
                                  for c in calls]

    def take(key: int, now: bool = True) -> None:
        layer, idx = layers[key]
        seen = [(records[i], pending[i]) for i in idx if any(g is not None for g in pending[i])]
        for i in idx:
            records[i] = pending[i] = None
        waiting[key] = -1
        if seen:
            with torch.no_grad():
                book.add(layer, seen, now)

    arrived = [False] * len(wanted)

    def hook_for(i: int, k: int, key: int, j: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            arrived[j] = True
            pending[i][k] = grad
            waiting[key] -= 1
            if waiting[key] == 0:
                take(key)

        return hook

    for j, (i, k, t) in enumerate(wanted):
        t.register_hook(hook_for(i, k, id(calls[i].layer.module), j))
    positions, remembered = asked(trainable, calls, wanted, fresh)
    lowest = [wanted[j][2] for j in positions]
    nodes = [t.grad_fn for _, _, t in wanted]  # the graph's nodes only: the outputs themselves are let go
    total = loss_of_output(trainable, loss_fn, output, targets)
    check_takes_part(trainable, total)  # a loss_fn that detaches its result
    refuse_outside_uses(trainable, calls, [total.grad_fn])
    del output, calls, wanted
    names, extra = unplanned(trainable)
    refuse_unplanned(trainable, names, torch.autograd.grad(total, lowest + extra, allow_unused=True)[len(lowest):])
    root = total.grad_fn
    del total, lowest
    missed = [nodes[j] for j, got in enumerate(arrived) if not got]
    if remembered and missed and reached(root, missed):
        raise StaleLowest
    del root, nodes, missed
    for key, left in waiting.items():  # layers some of whose outputs the loss does not reach
        if left > 0:
            take(key, now=False)
    with torch.no_grad():
        book.finish()
    return book


def hooked_sums(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object, chunk: int, groups: Groups,
                start: Callable[[], LazySums]) -> tuple[LazySums, dict[str, torch.Tensor]]:
    """({name: (*shape)} the clipped sum added into ``start()``, {name: (B,) squared norms} (for the check)).
    ``start()`` (the sums, noise drawn into them, each made when a layer's share first asks for it:
    :class:`~pergrad_viz.derived.sums.LazySums`) is called after the first backward, so that the sums and the forward
    pass's activations are not held at once, as plain training's ``.grad`` is made during its backward."""
    try:
        return _hooked_sums(trainable, loss_fn, inputs, targets, chunk, groups, start, fresh=False)
    except StaleLowest:  # the graph changed with the data: the batch again, from the call's first random state
        if trainable.call.draws is not None:
            trainable.call.draws.begin()
        return _hooked_sums(trainable, loss_fn, inputs, targets, chunk, groups, start, fresh=True)


def _hooked_sums(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object, chunk: int, groups: Groups,
                 start: Callable[[], LazySums], fresh: bool) -> tuple[LazySums, dict[str, torch.Tensor]]:
    batch = inputs.size
    squared: dict[str, torch.Tensor] = {}
    sums, checked = None, CheckedPass(trainable, batch)  # what a checked call forms too, from the shares here

    def zeros() -> torch.Tensor:
        return torch.zeros(batch, dtype=SQUARES, device=trainable.device)

    # hooks remove their hooks; autograd.grad leaves .grad alone; a reentrant checkpoint is refused, naming the fix
    with restoring_modes(trainable), refusing_reentrant_checkpoints():
        for first in range(0, batch, chunk):
            rows = slice(first, min(first + chunk, batch))
            book = _booked_backward(trainable, loss_fn, inputs.rows(rows), cut(targets, rows, batch), fresh,
                                    checked.direction)
            if checked.dots is not None:
                checked.add_dots(book.dots, rows)
            whole = rows.stop - rows.start == batch
            if whole:  # one chunk: the book's norms as they are, in float64 (one stack, not a conversion each)
                present = [n for n in trainable.names if n in book.squared]
                wide, total = {}, 0.0
                if present:
                    stacked = torch.stack([book.squared[n] for n in present]).to(SQUARES)
                    total = check_finite(stacked)
                    wide = dict(zip(present, stacked.unbind(0), strict=True))
                squared = {n: wide[n] if n in wide else zeros() for n in trainable.names}
            else:
                squared = squared or {n: zeros() for n in trainable.names}
                for name, sq in book.squared.items():
                    squared[name][rows] = sq
                total = check_finite(torch.stack([s[rows] for s in squared.values()]), rows.start)
            factors = clip_factors(squared if whole else {n: s[rows] for n, s in squared.items()}, groups,
                                   trainable.dtype, total)
            sums = start() if sums is None else sums
            if first == 0:
                checked.begin()
            with torch.no_grad():
                _add_book(book, factors, sums, checked.weights_for(rows), checked.combined)
            del book
    checked.keep()
    return sums, squared


def _add_book(book: _Book, factors: Mapping[str, torch.Tensor], sums: LazySums,
              weights: Mapping[str, torch.Tensor] | None, combined: LazySums | None) -> None:
    """Each layer's share (its per-sample gradients' for the others) added into ``sums`` with the clip factors
    {name: (B,)}, and where ``combined`` also with ``weights`` into it; each layer's captures let go once added."""
    while book.shares:
        share = book.shares.pop()
        share(factors, sums)
        if combined is not None:
            share(weights, combined)
    while book.dense:
        name, g = book.dense.pop()
        sums.add_weighted(name, g, factors[name])
        if combined is not None:
            combined.add_weighted(name, g, weights[name])


def materialised_sums(trainable: Trainable, resolved: str, strategy: str, loss_fn: LossFn, inputs: Batch,
                      targets: object, chunk_size: int | None, verify: bool, groups: Groups,
                      sums: LazySums) -> dict[str, torch.Tensor]:
    """The clipped sum into ``sums`` from :func:`pergrad_viz.per_sample_grads` with ``strategy``, one chunk of samples
    at a time (chunks sized for ``resolved``, the strategy it runs): exact, slower, O(chunk * P) memory. Returns the
    (B,) squared norms per name."""
    squared = {n: torch.empty(inputs.size, dtype=SQUARES, device=trainable.device) for n in trainable.names}
    for rows, grads in materialised_chunks(trainable, resolved, strategy, loss_fn, inputs, targets, chunk_size,
                                           verify):
        for name, g in grads.items():
            squared[name][rows] = row_squared_norms(g)
        total = check_finite(torch.stack([s[rows] for s in squared.values()]), rows.start)
        factors = clip_factors({n: s[rows] for n, s in squared.items()}, groups, trainable.dtype, total)
        with torch.no_grad():
            for name, g in grads.items():
                sums.add_weighted(name, g, factors[name])
        del grads
    return squared
