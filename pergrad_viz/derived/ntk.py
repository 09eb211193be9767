"""The empirical neural tangent kernel ``K[i, j] = J(x1_i) J(x2_j)^T``, from the layer rules.

J(x) is the (Y, P) Jacobian of one sample's Y outputs with respect to the P trainable parameters, so
``K = sum over layers of J_layer(x1_i) J_layer(x2_j)^T``. Per input set, one forward pass captures each
layer's input and one backward pass batched over the Y one-hot output vectors (as the ``hooks``
strategy's Jacobian) gives the output gradients g (Y, N, ...) of every layer. Then, per layer:

* ``nn.Linear`` (on (N, in), (N, T, in), or called several times): never the (N, Y, out, in) Jacobian:
  ``K[i,j,y,z] = sum_{t,s} (a_{i,t} . a_{j,s}) (g_{y,i,t} . g_{z,j,s})`` plus the bias term
  ``(sum_t g_{y,i,t}) . (sum_s g_{z,j,s})``; for (N, in) inputs this is ``(a_i . a_j) (g_{y,i} . g_{z,j})``;
* ``nn.Embedding``: the same with ``[idx_{i,t} == idx_{j,s}]`` in place of ``a_{i,t} . a_{j,s}``;
* either of them when that costs more than the layer's own Jacobian (many tokens, few parameters), every
  other layer with a rule (convolutions, LayerNorm, GroupNorm, BatchNorm in eval mode), and every layer
  owning a parameter tied to another layer: per parameter, the (Y, N, numel) Jacobian from the rules
  (summed over the layers sharing it), contracted over its elements.

Layers without a closed-form rule contribute their Jacobians from the per-layer fallback. Models where the
probe refuses ``hooks`` fall back to :func:`pergrad_viz.per_sample_jacobian` ``(flat=True)`` (N, Y, P) and
``einsum('iyp,jzp->ijyz')``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pergrad_viz import api
from pergrad_viz.core.batch import Batch, Inputs
from pergrad_viz.core.guards import check_output_count, check_reached, refusing_reentrant_checkpoints
from pergrad_viz.core.memory import budget_for, check_budget, result_bytes
from pergrad_viz.core.trainable import Trainable, computing_gradients, restoring_modes
from pergrad_viz.core.validate import batch_of
from pergrad_viz.derived.norms import ghost_rule, stack_calls
from pergrad_viz.engine.backward import output_gradients
from pergrad_viz.engine.capture import Layer
from pergrad_viz.engine.combination import check_ntk, check_ntk_rows
from pergrad_viz.engine.cotangents import has_fallback_layers, refuse_wrong_nesting
from pergrad_viz.engine.grouping import Seen, dense_grads, group_calls, tied_names
from pergrad_viz.engine.observe import forked_random
from pergrad_viz.engine.probe import plan_for
from pergrad_viz.rules import ghost_rule_for
from pergrad_viz.strategies import hooks

MODES: tuple[str, ...] = ("full", "trace")

# A Linear / Embedding / Conv kept in Gram form: (kind, a (N, T, in) or indices (N, T), g (Y, N, T, out), layer,
# the calls it came from).
Ghost = tuple[str, torch.Tensor, torch.Tensor, Layer, Seen]


@dataclass
class _Features:
    """What one chunk of N inputs contributes: Y, per-layer Gram pieces, per-parameter Jacobians."""

    outputs: int  # Y
    ghost: dict[nn.Module, Ghost] = field(default_factory=dict)
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # full parameter name -> (Y, N, numel)

    def dense_for(self, other: _Features, skip: set[nn.Module]) -> dict[str, torch.Tensor]:
        """Per-parameter Jacobians, with the Gram-form layers not in ``skip`` built from their pieces when
        ``other`` holds those parameters as Jacobians (a layer in Gram form for one chunk only)."""
        dense = dict(self.dense)
        for module, (_kind, _a, _g, layer, seen) in self.ghost.items():
            if module not in skip and any(name in other.dense for name in layer.local.values()):
                _add_dense(dense, layer.local, dense_grads(layer, seen))
        return dense


def _add_dense(dense: dict[str, torch.Tensor], local: dict[str, str], grads: dict[str, torch.Tensor]) -> None:
    """Add one layer's {local name: (Y, N, *shape)} Jacobians to {full name: (Y, N, numel)}; tied parameters
    add up."""
    for local_name, g in grads.items():
        name, flat = local[local_name], g.reshape(*g.shape[:2], -1)  # 0-dim parameters too
        dense[name] = flat if name not in dense else dense[name] + flat


@computing_gradients
def empirical_ntk(model: nn.Module, x1: Inputs, x2: Inputs | None = None, *, mode: str = "full",
                  chunk_size: int | None = None, max_bytes: int | None = None, verify: bool = True,
                  output: Callable[[object], torch.Tensor] | None = None) -> torch.Tensor:
    """The empirical NTK ``K[i, j] = J(x1_i) J(x2_j)^T`` over all trainable parameters.

    Args:
        model: any ``nn.Module``; left exactly as it was (no hooks, same parameters, ``.grad`` and modes).
        x1: (N1, ...) inputs on the model's device.
        x2: (N2, ...) inputs with the same feature shape and dtype as ``x1``; None means ``x2 = x1``
            (then K is computed once per pair of chunks and is exactly symmetric).
        mode: ``"full"`` for the (N1, N2, Y, Y) kernel, ``"trace"`` for its trace over the outputs (N1, N2).
        chunk_size: at most this many samples per forward/backward pass and per block of K.
        max_bytes: memory budget (default: half of the memory available on the device) for K and the chunks'
            features (each layer's output gradients for the Y outputs and its inputs): every chunk's kept where
            they fit, else two chunks' at a time (x2's computed again for each chunk of x1);
            :class:`~pergrad_viz.MemoryBudgetError`, naming a ``chunk_size`` that fits, is raised before computing
            where even that exceeds it.
        verify: check every row of K times a random vector against plain autograd on the batch
            (``pergrad_viz.engine.combination``) and one random entry K[i, j] against the two samples' Jacobians
            computed alone (on a mismatch K is computed from per-sample Jacobians instead); ``False`` skips it.
        output: picks the tensor whose Jacobians form K from what the model returns, as in
            :func:`pergrad_viz.per_sample_jacobian`: ``output=lambda out: out.logits`` for a Hugging Face model
            (default: the output itself).

    Returns:
        (N1, N2, Y, Y) for ``"full"`` (``K[i, j, y, z] = sum_p J(x1_i)[y, p] J(x2_j)[z, p]``), or (N1, N2)
        for ``"trace"``; Y is the number of output elements per sample (an output (N, *out) is flattened).

    Raises:
        ValueError: unknown ``mode``, ``x1`` / ``x2`` with different feature shapes, dtypes or output sizes,
            and everything :func:`pergrad_viz.per_sample_jacobian` refuses (empty batch, wrong device or
            dtype, no trainable parameters, bad ``chunk_size``, BatchNorm / Dropout in training mode).
    """
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; valid modes: 'full' (N1, N2, Y, Y) or 'trace' (N1, N2)")
    trainable, strategy, x1, chunk = api.prepare(model, x1, None, "auto", chunk_size, verify=verify,
                                                offers_randomness=False, output=output)
    if x2 is not None:
        x2 = batch_of(trainable, x2).sharing_as(x1)
        if x2.signature() != x1.signature():
            raise ValueError(
                "x1 and x2 must hold samples of the same kind (the same shapes past the batch dimension, dtypes and "
                f"arguments): x1 is {_describe(x1)}, x2 is {_describe(x2)}; pass x2 with shape "
                f"{_expected(x1)}, or x2=None for K(x1, x1)"
            )
    full = mode == "full"
    with restoring_modes(trainable):
        y_count = api.output_size(trainable, x1)
    n1, n2 = x1.size, x1.size if x2 is None else x2.size
    what = f"an empirical NTK of {n1} x {n2} samples" + (f" x {y_count}^2 outputs" if full else "")
    result = result_bytes(n1 * n2, 1, trainable.dtype, y_count * y_count if full else 1)
    per_sample = _feature_bytes(trainable, x1, y_count) if strategy == "hooks" else 0
    held = per_sample * (n1 + (0 if x2 is None else n2))  # every chunk's features kept, each computed once
    hold_all = result + held <= budget_for(max_bytes, trainable.device, result + held)
    check_budget(what=what, result=result, working=held if hold_all else 2 * per_sample * chunk, max_bytes=max_bytes,
                 allocate_result=True, device=trainable.device, batch=n1, chunk=chunk)
    if y_count == 0:  # no output element: an empty kernel (a sum over no outputs: zeros, for the trace)
        with restoring_modes(trainable), torch.no_grad(), forked_random(trainable.device):  # every sample: none
            for x in (x1,) if x2 is None else (x1, x2):
                for i in range(x.size):
                    check_output_count(f"sample {i} alone", trainable.outputs(x.sample(i)).numel(), 0)
        shape = (n1, n2, 0, 0) if full else (n1, n2)
        return torch.zeros(shape, dtype=trainable.dtype, device=trainable.device)
    if strategy == "hooks" and x2 is not None and api.resolve_strategy("auto", trainable, x2) != "hooks":
        strategy = "torch_func"

    def run(used: str) -> torch.Tensor:
        if used == "hooks":
            if has_fallback_layers(trainable, x1):  # the fallback's Jacobians: a nested vmap (engine.cotangents)
                shapes = {n: torch.empty((0, y_count, *p.shape), dtype=p.dtype, device=p.device)
                          for n, p in zip(trainable.names, trainable.params, strict=True)}
                with restoring_modes(trainable):
                    refuse_wrong_nesting(trainable, x1, "hooks", hooks.jacobian_untried, shapes)
            return _ghost_ntk(trainable, x1, x2, full, chunk, y_count, hold_all)
        return _jacobian_ntk(model, x1, x2, full, chunk_size, verify, used, output)

    def check(kernel: torch.Tensor, used: str) -> None:
        if used == "hooks":  # the per-sample Jacobians of the others were checked as they were computed
            check_ntk_rows(trainable, x1, x2, kernel, full, y_count)  # every row at once, where it can
            check_ntk(trainable, x1, x2, kernel, full)  # one entry, against the two samples alone

    return api.hand_over("auto", strategy, trainable, x1, run, check if verify else None, "ntk", may_race=False)


def _expected(x: Batch) -> str:
    return ", ".join(f"(N2, {', '.join(map(str, t.shape[1:]))})" for t in x.leaves())


def _describe(x: Batch) -> str:
    return ", ".join(f"{name} {tuple(t.shape)} {t.dtype}" for name, t in x.named_leaves())


def _jacobian_ntk(model: nn.Module, x1: Batch, x2: Batch | None, full: bool, chunk_size: int | None, verify: bool,
                  strategy: str = "auto", output: Callable[[object], torch.Tensor] | None = None) -> torch.Tensor:
    """The fallback: materialise (N, Y, P) Jacobians with :func:`pergrad_viz.per_sample_jacobian` and contract.

    With ``strategy`` as the hand-over (``api.hand_over``) goes: ``torch_func``, which works where a layer sees its
    input as (N*T, ...) rows, then the loop.
    """
    j1 = api.per_sample_jacobian(model, x1, strategy=strategy, flat=True, chunk_size=chunk_size, verify=verify,
                                 output=output)
    j2 = j1 if x2 is None else api.per_sample_jacobian(model, x2, strategy=strategy, flat=True,
                                                       chunk_size=chunk_size, verify=verify, output=output)
    _check_outputs(j1.shape[1], j2.shape[1])
    with torch.autocast(j1.device.type, enabled=False):  # the Jacobians' own dtype (a caller's autocast: bfloat16)
        kernel = torch.einsum("iyp,jzp->ijyz" if full else "iyp,jyp->ij", j1, j2)
    return _symmetrise(kernel, full) if x2 is None else kernel


def _feature_bytes(trainable: Trainable, x: Batch, y_count: int) -> int:
    """What one sample's features (:func:`_features`) hold at least: every hooked layer call's output gradients for
    the Y outputs (Y, N, ...) and its inputs (N, ...), from the plan's shapes (a layer's Jacobian may take more)."""
    numbers = 0
    for layer in plan_for(trainable, x).layers.values():
        for spec in layer.calls:
            numbers += y_count * sum(math.prod(r) for d, r in zip(spec.out_dims, spec.out_rest, strict=True)
                                     if d is not None)
            numbers += sum(math.prod(r) for d, r in zip(spec.in_dims, spec.in_rest, strict=True) if d is not None)
    return numbers * trainable.dtype.itemsize


def _ghost_ntk(trainable: Trainable, x1: Batch, x2: Batch | None, full: bool, chunk: int, alone: int,
               hold_all: bool = True) -> torch.Tensor:
    """K from the layers' features of each chunk; ``alone``: Y, sample 0's output elements alone. ``hold_all``:
    every chunk's features computed once and kept; else two chunks' at a time, each x2 chunk's computed again for
    every x1 chunk (memory bounded by the chunk, not the batch)."""
    rows1 = [slice(s, min(s + chunk, x1.size)) for s in range(0, x1.size, chunk)]
    rows2 = rows1 if x2 is None else [slice(s, min(s + chunk, x2.size)) for s in range(0, x2.size, chunk)]
    other = x1 if x2 is None else x2
    with restoring_modes(trainable), refusing_reentrant_checkpoints():
        f1 = [_features(trainable, x1.rows(r), full) for r in rows1] if hold_all else None
        f2 = f1 if x2 is None or not hold_all else [_features(trainable, x2.rows(r), full) for r in rows2]
        n2 = other.size
        kernel = None
        for b1, r1 in enumerate(rows1):
            a = f1[b1] if hold_all else _features(trainable, x1.rows(r1), full)
            if kernel is None:
                check_output_count("a sample in a batch", a.outputs, alone)
                shape = (x1.size, n2, a.outputs, a.outputs) if full else (x1.size, n2)
                kernel = torch.zeros(shape, dtype=trainable.dtype, device=trainable.device)
            for b2, r2 in enumerate(rows2):
                if x2 is None and b2 < b1:  # K(x, x) is symmetric: reuse the block above the diagonal
                    block = kernel[r2, r1].transpose(0, 1)
                    kernel[r1, r2] = block.transpose(2, 3) if full else block
                    continue
                b = f2[b2] if hold_all else a if x2 is None and b2 == b1 else _features(trainable, other.rows(r2),
                                                                                           full)
                _check_outputs(a.outputs, b.outputs)
                block = _kernel(a, b, full)
                if block is not None:  # None: no layer reaches the output in both chunks, J J^T = 0
                    kernel[r1, r2] = block
                del b
    return _symmetrise(kernel, full) if x2 is None else kernel


def _features(trainable: Trainable, inputs: Batch, full: bool) -> _Features:
    """1 forward with hooks and 1 backward batched over the Y outputs; per layer ghost pieces or a Jacobian."""
    calls, grads, y_count = output_gradients(trainable, inputs)  # each (Y, N, ...)
    check_reached(trainable, calls, "model output")
    features = _Features(y_count)
    tied = tied_names(calls)
    for layer, seen in group_calls(calls, grads).values():
        ghost = ghost_rule(layer)
        if ghost is not None and tied.isdisjoint(layer.local.values()):
            a, g = stack_calls(layer, seen)
            if gram_is_cheaper(ghost.kind, layer.module, a.shape[1], y_count, full):
                features.ghost[layer.module] = (ghost.kind, a, g, layer, seen)
                continue
        _add_dense(features.dense, layer.local, dense_grads(layer, seen))
    return features


def gram_is_cheaper(kind: str, module: nn.Module, tokens: int, y_count: int, full: bool) -> bool:
    """Whether the Gram form of a ghost-rule layer (``kind``: "linear", "embedding") costs fewer multiply-adds per
    pair (i, j) than contracting the layer's (Y, P_layer) Jacobians (T = S = ``tokens`` positions per sample)."""
    gram, dense = ghost_rule_for(module).gram_cost(module, tokens, y_count, y_count * y_count if full else y_count)
    return gram <= dense


def _kernel(a: _Features, b: _Features, full: bool) -> torch.Tensor | None:
    """The block K(a, b): (Na, Nb, Y, Y) if ``full`` else (Na, Nb), summed over the layers both saw
    (None if there is no such layer)."""
    out, z = ("ijyz", "z") if full else ("ij", "y")
    both = [m for m in a.ghost if m in b.ghost]  # ordered, so that the sum is reproducible
    terms = [_gram_kernel(a.ghost[m], b.ghost[m], full) for m in both]
    dense_a, dense_b = a.dense_for(b, set(both)), b.dense_for(a, set(both))
    for name in dense_a:
        if name in dense_b:
            terms.append(torch.einsum(f"yip,{z}jp->{out}", dense_a[name], dense_b[name]))
    return sum(terms[1:], terms[0]) if terms else None


def _gram_kernel(ga: Ghost, gb: Ghost, full: bool) -> torch.Tensor:
    """Linear / Embedding term: sum_{t,s} A[i,j,t,s] (g_{y,i,t} . g_{z,j,s}) (+ the bias term)."""
    kind, a1, g1, layer, _seen = ga
    local = layer.local
    a2, g2 = gb[1], gb[2]
    out, z = ("ijyz", "z") if full else ("ij", "y")
    term = None
    if "weight" in local:
        overlap = ghost_rule_for(layer.module).overlap(a1, a2, g1.dtype)  # (N1, N2, T, S)
        if overlap.shape[2] == overlap.shape[3] == 1:  # (N, in) inputs: (a_i . a_j) (g_{y,i} . g_{z,j})
            gg = torch.einsum(f"yio,{z}jo->{out}", g1[:, :, 0], g2[:, :, 0])
            term = gg * overlap[:, :, 0, 0].view(*overlap.shape[:2], *(1,) * (gg.dim() - 2))
        else:
            term = torch.einsum(f"ijts,yito,{z}jso->{out}", overlap, g1, g2)
    if "bias" in local:
        bias = torch.einsum(f"yio,{z}jo->{out}", g1.sum(2), g2.sum(2))
        term = bias if term is None else term + bias
    return term


def _check_outputs(y1: int, y2: int) -> None:
    if y1 != y2:
        raise ValueError(
            f"the model gives {y1} outputs per sample for x1 but {y2} for x2 (or for another chunk): the "
            "kernel needs the same Y for all inputs; pass inputs of one size (or pad them)"
        )


def _symmetrise(kernel: torch.Tensor, full: bool) -> torch.Tensor:
    """(K + K^T) / 2 with K^T[i, j, y, z] = K[j, i, z, y]: exact symmetry for K(x, x)."""
    transposed = kernel.transpose(0, 1)
    return (kernel + (transposed.transpose(2, 3) if full else transposed)) / 2
