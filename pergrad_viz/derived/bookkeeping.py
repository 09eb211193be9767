"""The clipped sum of DP-SGD by book-keeping (Bu et al., ICML 2023): one hooked forward, one backward to the layer
outputs, then per layer the ghost norm and, once every sample's clip factor c_i is known, ``sum_i c_i g_i`` from
the same captured inputs and output gradients (a Linear: ``(c G)^T A``, one matmul over the B * T rows).

Shapes: B samples, K clipping groups (one for flat clipping), ``*shape`` a parameter's shape.

A layer without a weighted-sum rule (``pergrad_viz.rules.register_weighted_sum``), or one owning a tied parameter,
gets its own per-sample gradients (B, *shape) from its rule or the per-layer fallback, and the weighted sum of
those: that layer only, never the whole model. Where the hooks strategy cannot run, :func:`materialised_sums`
builds the per-sample gradients with :func:`pergrad_viz.per_sample_grads` one chunk at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.derived.clipping import EPS
from pergrad_viz.derived.norms import ghost_rule, materialised_chunks, row_squared_norms
from pergrad_viz.engine.capture import Layer, loss_gradients
from pergrad_viz.engine.grouping import Seen, dense_grads, group_calls, tied_names
from pergrad_viz.engine.probe import LayerKind
from pergrad_viz.rules import ghost_rule_for, linear_views_for, weighted_sum_rule_for
from pergrad_viz.rules.linear import LinearGhost, linear_weighted_sum

# Clipping groups: (bound C_k, the parameter names clipped together), in order.
Groups = Sequence[tuple[float, tuple[str, ...]]]


def clip_factors(squared: Mapping[str, torch.Tensor], groups: Groups) -> dict[str, torch.Tensor]:
    """{name: (B,) c} with c = min(1, C_k / (||g_i||_k + 1e-6)), the norm over the parameters of name's group k."""
    factors = {}
    for bound, names in groups:
        norm = torch.stack([squared[n] for n in names]).sum(0).sqrt()  # (B,)
        c = (bound / (norm + EPS)).clamp(max=1.0)
        factors.update(dict.fromkeys(names, c))
    return factors


def _add_weighted(dest: torch.Tensor, g: torch.Tensor, c: torch.Tensor) -> None:
    """dest (*shape) += sum_i c_i g_i of a (B, *shape) per-sample gradient, one ``addmm_`` into ``dest``."""
    dest.view(1, -1).addmm_(c.to(g.dtype).unsqueeze(0), g.reshape(g.shape[0], -1))


# One layer's share of the clipped sum once the clip factors {full name: (B,)} are known, added into the sums
# {full name: (*shape)}.
SumOf = Callable[[Mapping[str, torch.Tensor], dict[str, torch.Tensor]], None]


def _ghost_layer(layer: Layer, seen: Seen) -> tuple[dict[str, torch.Tensor], SumOf] | None:
    """A layer with a weighted-sum rule: ({full name: (B,) squared norm}, its share of the sum), else None."""
    ghost = ghost_rule(layer)
    rule = weighted_sum_rule_for(layer.module) if ghost is not None else None
    if rule is None:
        return None
    module, local = layer.module, layer.local
    seen_first = [(call.activation, call.rule_grad(gs[0])[0]) for call, gs in seen]
    a, g = ghost_rule_for(module).stack(module, [(a, g[None]) for a, g in seen_first])
    squared = {local[ln]: sq for ln, sq in ghost.squared_norms(module, a, g[0], local).items()}
    del a, g  # the stacked form (a convolution's columns) is not kept

    def share(factors: Mapping[str, torch.Tensor], sums: dict[str, torch.Tensor]) -> None:
        rule(module, seen_first, {ln: factors[n] for ln, n in local.items()}, {ln: sums[n] for ln, n in local.items()})

    return squared, share


def _call_layer(layer: Layer, seen: Seen) -> tuple[dict[str, torch.Tensor], SumOf] | None:
    """A call layer made of Linear maps (``register_linear_views``), called once: each map's ghost norm and
    book-keeping; None where the layer's rule must give its per-sample gradients."""
    views_rule = linear_views_for(layer.module) if layer.kind is LayerKind.CALL else None
    if views_rule is None or len(seen) != 1:
        return None
    call, gs = seen[0]
    outputs = len(call.outputs)
    views = views_rule(layer.module, call.inputs, gs[:outputs], call.captured, gs[outputs:])
    if views is None:
        return None
    local = layer.local
    pairs = []  # (a (B, T, in), g (B, T, out), {"weight" / "bias": full name}) of the trainable ones
    for a, g, names in views:
        full = {role: local[ln] for role, ln in names.items() if ln in local}
        if full:
            a3, g3 = a.reshape(a.shape[0], -1, a.shape[-1]), g.reshape(g.shape[0], -1, g.shape[-1])
            pairs.append((a3, g3, full))
    if {n for *_, full in pairs for n in full.values()} != set(local.values()):
        return None  # a parameter of the layer outside its Linear maps (bias_k, bias_v)
    squared = {}
    for a, g, full in pairs:
        for role, sq in LinearGhost.squared_norms(None, a, g, full).items():
            squared[full[role]] = sq

    def share(factors: Mapping[str, torch.Tensor], sums: dict[str, torch.Tensor]) -> None:
        for a, g, full in pairs:
            linear_weighted_sum(None, [(a, g)], {r: factors[n] for r, n in full.items()},
                                {r: sums[n] for r, n in full.items()})

    return squared, share


def hooked_sums(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object, chunk: int, groups: Groups,
                sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Add the clipped sum into ``sums`` {name: (*shape)}; returns {name: (B,) squared norms} (for the check)."""
    batch = inputs.size
    squared = {n: torch.zeros(batch, dtype=trainable.dtype, device=trainable.device) for n in trainable.names}
    with restoring_modes(trainable):  # hooks remove their hooks; autograd.grad leaves .grad alone
        for start in range(0, batch, chunk):
            rows = slice(start, min(start + chunk, batch))
            calls, grads = loss_gradients(trainable, loss_fn, inputs.rows(rows), cut(targets, rows, batch))
            tied = tied_names(calls)
            shares: list[SumOf] = []  # the layers whose share comes from the captures
            dense: dict[str, torch.Tensor] = {}  # the other layers' (B, *shape), summed over tied layers
            for layer, seen in group_calls(calls, grads).values():
                entry = None
                if tied.isdisjoint(layer.local.values()):
                    entry = _ghost_layer(layer, seen) or _call_layer(layer, seen)
                if entry is not None:
                    for name, sq in entry[0].items():
                        squared[name][rows] = sq
                    shares.append(entry[1])
                    continue
                for ln, g in dense_grads(layer, seen).items():
                    name = layer.local[ln]
                    dense[name] = g[0] if name not in dense else dense[name] + g[0]
            for name, g in dense.items():
                squared[name][rows] = row_squared_norms(g)
            factors = clip_factors({n: s[rows] for n, s in squared.items()}, groups)
            with torch.no_grad():
                for share in shares:
                    share(factors, sums)
                for name, g in dense.items():
                    _add_weighted(sums[name], g, factors[name])
            del calls, grads, shares, dense
    return squared


def materialised_sums(trainable: Trainable, resolved: str, strategy: str, loss_fn: LossFn, inputs: Batch,
                      targets: object, chunk_size: int | None, verify: bool, groups: Groups,
                      sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The clipped sum into ``sums`` from :func:`pergrad_viz.per_sample_grads` with ``strategy``, one chunk of samples
    at a time (chunks sized for ``resolved``, the strategy it runs): exact, slower, O(chunk * P) memory. Returns the
    (B,) squared norms per name."""
    squared = {n: torch.empty(inputs.size, dtype=trainable.dtype, device=trainable.device) for n in trainable.names}
    for rows, grads in materialised_chunks(trainable, resolved, strategy, loss_fn, inputs, targets, chunk_size,
                                           verify):
        for name, g in grads.items():
            squared[name][rows] = row_squared_norms(g)
        factors = clip_factors({n: s[rows] for n, s in squared.items()}, groups)
        with torch.no_grad():
            for name, g in grads.items():
                _add_weighted(sums[name], g, factors[name])
        del grads
    return squared
