"""Per-sample gradient norms, without materialising the (B, P) per-sample gradients where the model allows it.

Shapes: B samples, P trainable scalars, T positions a layer sees per sample (tokens, or the number of
times a shared layer is called), ``in`` / ``out`` a Linear layer's features, V x D an Embedding.

With the ``hooks`` strategy (what ``"auto"`` picks unless the probe of the model says it cannot be trusted)
the norms come from one forward pass that captures each layer's input and one backward pass to the layer
outputs, then, per layer, a few samples at a time within a budget (:func:`ghost_squared_norms`):

* ``nn.Linear``: on (B, in) ``||g_i||^2 ||a_i||^2`` (the "ghost norm"); on (B, T, in) ``sum_{t,s} (a_t . a_s)
  (g_t . g_s)`` from two (B, T, T) Grams where ``T * T < in * out``, else its own (B, out, in) gradient;
* ``nn.Embedding``: the rows a sample touches, summed per (sample, token): never the (B, V, D) gradient;
* ``nn.Conv1d`` / ``nn.Conv2d`` (groups=1): a Linear from each patch's C_in * k values to C_out at the L output
  positions (or from the input's pixels' Gram where cheaper than im2col: ``GhostRule.direct_norms``);
* every other layer: that layer's per-sample gradient (B, *param.shape) from its rule, then its norm;
* a parameter tied between layers: the layers' own squared norms plus twice their cross inner products
  (:func:`~pergrad_viz.derived.tied.tied_squared_norms`), from each layer's ghost factors (``GhostRule.factors``)
  or its per-sample gradient.

Other strategies (and ``"auto"`` where the probe refuses ``hooks``) materialise the per-sample gradients
with :func:`pergrad_viz.per_sample_grads` one chunk of samples at a time and take their norms.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_map

from pergrad_viz import api
from pergrad_viz.core.batch import Batch, Inputs, cut, normal_tensor
from pergrad_viz.core.guards import check_reached, refusing_reentrant_checkpoints
from pergrad_viz.core.layout import sample_rows
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.memory import default_budget, result_bytes
from pergrad_viz.core.numbers import SQUARES
from pergrad_viz.core.randomness import randomness_of
from pergrad_viz.core.trainable import Trainable, computing_gradients, restoring_modes
from pergrad_viz.core.validate import check_flags, check_loss
from pergrad_viz.derived.checked_pass import CheckedPass
from pergrad_viz.derived.tied import TiedPart, dense_part, tied_squared_norms
from pergrad_viz.engine.backward import loss_gradients
from pergrad_viz.engine.capture import Layer
from pergrad_viz.engine.certify import check_norms
from pergrad_viz.engine.combination import check_combination
from pergrad_viz.engine.grouping import Seen, dense_grads, group_calls, tied_names
from pergrad_viz.engine.plan import LayerKind
from pergrad_viz.rules import GhostRule, ghost_rule_for, positions
from pergrad_viz.rules.doubts import deferring, doubts_for
from pergrad_viz.rules.linear import LinearGhost, gram_is_faster
from pergrad_viz.rules.scaling import wide_row_norms
from pergrad_viz.strategies import working_bytes


@computing_gradients
def per_sample_grad_norms(model: nn.Module, loss_fn: LossFn, inputs: Inputs, targets: object, *,
                          strategy: str = "auto", per_parameter: bool = False, chunk_size: int | None = None,
                          verify: bool = True, model_kwargs: Mapping | None = None, randomness: str = "error"
                          ) -> torch.Tensor | dict[str, torch.Tensor]:
    """The L2 norm of each sample's gradient, over all trainable parameters (or per parameter).

    The gradient of sample i is the one :func:`pergrad_viz.per_sample_grads` returns: the gradient of
    ``loss_fn(model(inputs[i:i+1]), targets[i:i+1])`` with respect to every parameter with
    ``requires_grad``. With ``strategy="auto"`` or ``"hooks"`` on a model whose layers all have rules, the
    (B, P) gradients are never built (see the module docstring); otherwise they are built ``chunk_size``
    samples at a time (by default as many as fit in half of the free memory) and reduced to norms.

    Args:
        model: any ``nn.Module``; left exactly as it was (no hooks, same parameters, ``.grad`` and modes).
        loss_fn: ``loss_fn(output, targets) -> scalar``, e.g. ``nn.CrossEntropyLoss()``.
        inputs: (B, ...) on the model's device (integer dtype for Embedding models), or a tuple / dict of
            tensors as :func:`pergrad_viz.per_sample_grads` takes them.
        targets: (B, ...), or a tuple / dict of (B, ...) tensors.
        strategy: ``"auto"`` or one of :data:`pergrad_viz.STRATEGIES`.
        per_parameter: return ``{name: (B,)}`` norms per trainable parameter instead of the total (B,).
        chunk_size: process at most this many samples at a time.
        model_kwargs: more keyword arguments for the model, cut like the inputs (see ``pergrad_viz.core.batch``).
        verify: the per-call check, as :func:`pergrad_viz.per_sample_grads` (docs/api.md); ``False`` skips it.
        randomness: ``"error"`` or ``"different"`` (each sample's gradient under its own dropout mask), as
            :func:`pergrad_viz.per_sample_grads`.

    Returns:
        (B,) norms in the parameters' dtype, or ``{name: Tensor (B,)}`` in ``named_parameters()`` order
        (trainable parameters only) if ``per_parameter``; the total is the root of the sum of their squares.

    Raises:
        ValueError: as :func:`pergrad_viz.per_sample_grads` (mismatched batch sizes, empty batch, unknown
            strategy, no trainable parameters, bad ``chunk_size``); :class:`UnsupportedModelError` for
            BatchNorm or Dropout in training mode, or ``strategy="hooks"`` where it cannot be trusted.
        TypeError: ``per_parameter`` is not a bool.
    """
    check_flags(per_parameter=per_parameter)
    check_loss(loss_fn)  # None too: api.prepare takes None for a Jacobian
    targets = tree_map(normal_tensor, targets)
    trainable, resolved, inputs, chunk = api.prepare(model, inputs, targets, strategy, chunk_size, loss_fn,
                                                      model_kwargs, randomness=randomness, verify=verify)

    def run(used: str) -> dict[str, torch.Tensor]:
        if used == "hooks":
            return _ghost_squared_norms(trainable, loss_fn, inputs, targets, chunk)
        return _materialised_squared_norms(trainable, used, used, loss_fn, inputs, targets, chunk_size, verify)

    def check(squared: dict[str, torch.Tensor], used: str) -> None:
        if used == "hooks":  # the other strategies' gradients were checked as they were computed
            check_combination(trainable, loss_fn, inputs, targets, used, squared)  # every row at once
            check_norms(trainable, loss_fn, inputs, targets, squared, used)  # one sample alone

    squared = api.hand_over(strategy, resolved, trainable, inputs, run, check if verify else None, "norms", targets,
                            may_race=False)  # ghost norms never build (B, P); torch_func would
    if per_parameter:  # the squares are float64 (a float32 norm over 1.8e19 squares to inf); the norms are not
        return {name: s.sqrt().to(trainable.dtype) for name, s in squared.items()}
    return torch.stack(list(squared.values())).sum(0).sqrt().to(trainable.dtype)


def _ghost_squared_norms(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
                         chunk: int) -> dict[str, torch.Tensor]:
    """{name: (B,) squared norms}: per chunk 1 forward with hooks, 1 backward to the layer outputs."""
    batch, checked = inputs.size, CheckedPass(trainable, inputs.size)  # what a checked call forms too
    squared = {n: torch.zeros(batch, dtype=SQUARES, device=trainable.device) for n in trainable.names}
    with restoring_modes(trainable), refusing_reentrant_checkpoints():
        for start in range(0, batch, chunk):
            rows = slice(start, min(start + chunk, batch))
            calls, grads = loss_gradients(trainable, loss_fn, inputs.rows(rows), cut(targets, rows, batch))
            check_reached(trainable, calls)
            if start == 0:
                checked.begin()
            tied = tied_names(calls)
            parts: dict[str, list[TiedPart]] = {}  # tied parameters: each layer's share of their norm
            doubts = doubts_for(trainable.device)  # a GPU: the Grams' range read once, below
            for layer, seen in group_calls(calls, grads).values():
                checked.layer(layer, seen, rows)
                if tied.isdisjoint(layer.local.values()):
                    def write(layer: Layer = layer, seen: Seen = seen, rows: slice = rows) -> None:
                        for local_name, sq in layer_squared_norms(layer, seen).items():
                            squared[layer.local[local_name]][rows] = sq

                    with doubts.layer(write) if doubts is not None else contextlib.nullcontext():
                        write()  # on a GPU unscaled, computed again below where the values are extreme
                    continue
                for name, sq, part in _tied_layer(layer, seen, tied):
                    if part is None:
                        squared[name][rows] = sq
                    else:
                        parts.setdefault(name, []).append(part)
            if doubts is not None:
                doubts.settle()
            for name, p in parts.items():
                squared[name][rows] = tied_squared_norms(p)
    checked.keep()
    return squared


def _tied_layer(layer: Layer, seen: Seen, tied: set[str]) -> list[tuple[str, torch.Tensor, TiedPart | None]]:
    """[(full name, (B,) squared norm of this layer's share, its part of a tied weight's norm or None)]: a ghost
    layer's factors (``GhostRule.factors``), else this layer's per-sample gradient (B, *shape) as a part."""
    ghost, out = ghost_rule(layer), []
    if ghost is not None:
        a, g = stack_calls(layer, seen)
        for ln, sq in ghost.squared_norms(layer.module, a, g[0], layer.local).items():
            name = layer.local[ln]
            factors = ghost.factors(layer.module, a, g[0]) if ln == "weight" and name in tied else None
            if name in tied:
                part = (*factors, sq) if factors is not None else dense_part(dense_grads(layer, seen)[ln][0], sq)
            out.append((name, sq, part if name in tied else None))
        return out
    for ln, g in dense_grads(layer, seen).items():
        name, sq = layer.local[ln], row_squared_norms(g[0])
        out.append((name, sq, dense_part(g[0], sq) if name in tied else None))
    return out


def _materialised_squared_norms(trainable: Trainable, resolved: str, strategy: str, loss_fn: LossFn,
                                inputs: Batch, targets: object, chunk_size: int | None,
                                verify: bool = True) -> dict[str, torch.Tensor]:
    """{name: (B,) squared norms} from :func:`pergrad_viz.per_sample_grads` with ``strategy``, one chunk of samples
    at a time (chunks sized for ``resolved``, the strategy it runs)."""
    squared = {n: torch.empty(inputs.size, dtype=SQUARES, device=trainable.device) for n in trainable.names}
    for rows, grads in materialised_chunks(trainable, resolved, strategy, loss_fn, inputs, targets, chunk_size,
                                           verify):
        for name, g in grads.items():
            squared[name][rows] = row_squared_norms(g)
    return squared


def materialised_chunks(trainable: Trainable, resolved: str, strategy: str, loss_fn: LossFn, inputs: Batch,
                        targets: object, chunk_size: int | None, verify: bool):
    """(rows, {name: (chunk, *shape)}) per chunk of samples, from :func:`pergrad_viz.per_sample_grads` with
    ``strategy``; chunks of ``chunk_size``, or as many samples as fit the default budget for ``resolved``."""
    batch = inputs.size
    if chunk_size is None:
        p = trainable.num_params
        per_sample = result_bytes(1, p, trainable.dtype) + working_bytes(resolved, 1, 1, p, trainable.dtype)
        chunk = max(1, min(batch, default_budget(trainable.device) // per_sample))
    else:
        chunk = min(chunk_size, batch)
    for start in range(0, batch, chunk):
        rows = slice(start, min(start + chunk, batch))
        yield rows, api.per_sample_grads(trainable.model, loss_fn, inputs.rows(rows), cut(targets, rows, batch),
                                         strategy=strategy, verify=verify, randomness=randomness_of(trainable))


# Pieces shared with pergrad_viz.derived.ntk ------------------------------------------------------------------


def row_squared_norms(g: torch.Tensor) -> torch.Tensor:
    """(B,) squared L2 norms of the rows of a (B, *shape) per-sample gradient (``core.layout.sample_rows``)."""
    return wide_row_norms(sample_rows(g)).square()  # float64: no overflow in the square


# A layer's share of a tied weight's per-sample gradient: (left, right, own) with the gradient read as the matrix
# W.view(rows, -1) = sum_t outer(left_t, right_t) (``GhostRule.factors``) and own (B,) its squared norm alone.
def ghost_rule(layer: Layer) -> GhostRule | None:
    """The layer's :class:`~pergrad_viz.rules.GhostRule` where its closed-form rule applies, else None."""
    return ghost_rule_for(layer.module) if layer.kind is LayerKind.RULE else None


def ghost_kind(layer: Layer) -> str | None:
    """``"linear"`` or ``"embedding"`` for the layers handled without their per-sample gradient, else None."""
    ghost = ghost_rule(layer)
    return None if ghost is None else ghost.kind


# A layer's norms are computed for as many samples at once as keep their temporaries (scaled copies of a and g)
# within max(NORM_BYTES, the layer's captures / NORM_PARTS), a convolution's (its columns, k * k times its input, also
# scaled) within max(COLUMNS_BYTES, its captures): they come on top of what the backward holds (book-keeping keeps
# every layer's captures for its share). Each chunk costs some ten small ops more.
NORM_BYTES = 256 << 10
NORM_PARTS = 2
COLUMNS_BYTES = 4 << 20


def samples_at_once(batch: int, per_sample: int, budget: int) -> int:
    """How many samples a layer's norms take at once: ``per_sample`` bytes of temporaries each, within ``budget``."""
    return max(1, min(batch, budget // max(1, per_sample)))


def norm_step(ghost: GhostRule, module: nn.Module | None,
              seen_first: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int | None]:
    """(how many samples :func:`ghost_squared_norms` takes at once, the bytes a sample of the rule's direct form
    takes or None where it has none for these shapes): what it decides from the calls' shapes alone."""
    batch = seen_first[0][0].shape[0]
    held = sum(a.nbytes + g.nbytes for a, g in seen_first)
    per_sample, budget = held // batch, max(NORM_BYTES, held // NORM_PARTS)  # the scaled copies of a and g
    direct = ghost.direct_bytes(module, seen_first) if hasattr(ghost, "direct_bytes") else None
    if direct is not None:  # a convolution's pixels' Gram
        per_sample, budget = direct, max(COLUMNS_BYTES, held)
    elif ghost.kind == "linear" and (seen_first[0][0].device.type == "cpu" or deferring(*seen_first[0])):
        per_sample = _linear_temporaries(seen_first)  # scaled copies only where values are extreme (products_fit)
    elif ghost.kind == "conv":  # and the columns, C_in * k values at each of the L output positions, scaled too
        columns = math.prod(module.weight.shape[1:])
        per_sample += 2 * sum(columns * math.prod(g.shape[2:]) * g.element_size() for _, g in seen_first)
        budget = max(COLUMNS_BYTES, held)
    return samples_at_once(batch, per_sample, budget), direct


def ghost_squared_norms(ghost: GhostRule, module: nn.Module | None,
                        seen_first: Sequence[tuple[torch.Tensor, torch.Tensor]], local) -> dict[str, torch.Tensor]:
    """{local name: (B,) squared norm} of a ghost-rule layer's calls ``[(activation (B, ...), grad_output (B,
    ...))]``: the rule's direct form where it has one for these shapes (``GhostRule.direct_norms``), else its stacked
    form, either a few samples at a time (:func:`samples_at_once`)."""
    batch = seen_first[0][0].shape[0]
    step, direct = norm_step(ghost, module, seen_first)
    chunks = []
    for start in range(0, batch, step):
        part = seen_first if step >= batch else [(a[start:start + step], g[start:start + step]) for a, g in seen_first]
        if direct is not None:
            chunks.append(ghost.direct_norms(module, part, local))
            continue
        if len(part) == 1 and ghost.stack is LinearGhost.stack:
            chunks.append(one_linear_call_norms(ghost, module, *part[0], local))
            continue
        a, g = ghost.stack(module, [(a, g[None]) for a, g in part])
        chunks.append(ghost.squared_norms(module, a, g[0], local))
        del a, g
    if len(chunks) == 1:
        return chunks[0]
    return {ln: torch.cat([c[ln] for c in chunks]) for ln in chunks[0]}


def one_linear_call_norms(ghost: GhostRule, module: nn.Module | None, a: torch.Tensor, g: torch.Tensor, local
                          ) -> dict[str, torch.Tensor]:
    """``ghost.squared_norms`` of a Linear's one call (activation (B, ..., in), grad_output (B, ..., out)): its rows
    as they are, (B, T, width), without the stacking of several calls (no N dimension added and taken off)."""
    return ghost.squared_norms(module, positions(a, a.shape[0]), positions(g, g.shape[0]), local)


def _linear_temporaries(seen_first) -> int:
    """Bytes per sample of a Linear's norms computed as they are (``pergrad_viz.rules.products_fit``): two (T, T)
    Gram matrices, or its (out, in) gradient where that is faster (``gram_is_faster``)."""
    a, g = seen_first[0]
    tokens = sum(math.prod(a.shape[1:-1]) for a, _ in seen_first)
    gram = gram_is_faster(tokens, a.shape[-1], g.shape[-1])
    cells = 2 * tokens * tokens if gram else a.shape[-1] * g.shape[-1]
    return cells * g.element_size()


def stack_calls(layer: Layer, seen: Seen) -> tuple[torch.Tensor, torch.Tensor]:
    """All calls of a ghost-rule layer as one call on T positions (a shared layer's calls add up): for a Linear
    a is (B, T, in) and g (N, B, T, out); for an Embedding a is the (B, T) indices and g (N, B, T, D)."""
    seen_first = [(call.activation, call.rule_grad(gs[0])) for call, gs in seen]  # the samples first
    return ghost_rule_for(layer.module).stack(layer.module, seen_first)


def layer_squared_norms(layer: Layer, seen: Seen) -> dict[str, torch.Tensor]:
    """{local name: (B,) squared per-sample gradient norm} of one layer; ``seen`` has N = 1."""
    ghost = ghost_rule(layer)
    if ghost is None:  # convolutions, norms, recurrent, fallback: this one layer's (B, *param.shape) gradient
        return {ln: row_squared_norms(t[0]) for ln, t in dense_grads(layer, seen).items()}
    calls = [(call.activation, call.rule_grad(gs[0])[0]) for call, gs in seen]  # the samples first
    return ghost_squared_norms(ghost, layer.module, calls, layer.local)
