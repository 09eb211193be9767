"""The every-row check of results formed without the per-sample gradients (book-keeping's clipped sum, the ghost
norms): the strategy, on a call the check will look at, also forms the random combination ``sum_i w_i g_i`` of
the rows it never builds, from the same captures and rules in the same pass (each layer's weighted sum with weights
w instead of clip factors); the check compares it with the gradient of ``sum_i w_i L_i`` from one plain forward and
backward of the batch (:func:`pergrad_viz.engine.certify.check_grads`' reference). A coupling between samples that
the probe of a few samples missed (a forward that mixes rows only in larger batches) puts other samples' terms into
the rows, and shows here whatever sample it touches, as it does for ``per_sample_grads``; the one sample alone
(``check_norms``) still covers the rest."""

from __future__ import annotations

import math

import torch

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.float64 import to_float64
from pergrad_viz.core.guards import check_output_count
from pergrad_viz.core.layout import flat_outputs
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.certify import (
    Float64Copies,
    check_norms,
    draw,
    raise_if_failed,
    random_normal,
    weighted_reference,
)
from pergrad_viz.engine.forward_mode import direction_scale, screened_jvp, without_padding_rows
from pergrad_viz.engine.references import dense, grad_of, weighted_outputs
from pergrad_viz.engine.schedule import unseen_graphs
from pergrad_viz.engine.verdict import fails, tolerance, verdict, worst_row
from pergrad_viz.errors import CheckFailedError


def combination_weights(trainable: Trainable, batch: int) -> torch.Tensor | None:
    """(B,) random weights (the check's own generator) where this call will be checked (its schedule says it is
    due, or it took a graph between the layers no check saw; ask after the capture), else None."""
    call = trainable.call
    if not call.checked or not (call.due or unseen_graphs(trainable)):
        return None
    return random_normal((batch,), trainable.params[0])


def check_direction(trainable: Trainable) -> dict[str, torch.Tensor] | None:
    """A random direction {name: like the parameter} (an Embedding's padding row 0) where this call's check is due
    (known before the pass) and draws no random numbers: the strategy then also forms ``g_i . v`` per sample
    (``derived/directions.py``), screened against each sample alone by forward mode; else None."""
    call = trainable.call
    if not call.checked or not call.due or call.draws is not None:
        return None
    return without_padding_rows(trainable, {n: random_normal(tuple(p.shape), p) for n, p in zip(
        trainable.names, trainable.params, strict=True)})


def keep_combination(trainable: Trainable, weights: torch.Tensor, combined: dict[str, torch.Tensor],
                     direction: dict[str, torch.Tensor] | None = None, dots: dict[str, torch.Tensor] | None = None
                     ) -> None:
    """Hand the combination formed, ``{name: sum_i w_i g_i}`` of every trainable parameter, to the check; with the
    direction of :func:`check_direction` and ``{name: (B,) g_i . v}`` where they were formed too."""
    trainable.call.combination = (weights, combined, direction, dots)


def check_combination(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object, strategy: str,
                      squared: dict[str, torch.Tensor] | None = None) -> None:
    """Raise :class:`~pergrad_viz.errors.CheckFailedError` unless the combination the strategy formed equals the
    gradient of ``sum_i w_i L_i`` from one plain backward of the batch (under ``randomness="different"`` the batch's
    draws replayed); nothing where the strategy formed none. Where it formed ``g_i . v`` too, every row is screened
    against its sample alone by forward mode, the worst row beyond rounding checked alone (``squared``: the
    result's (B,) squared norms per parameter, for the scale)."""
    made, trainable.call.combination = trainable.call.combination, None
    if made is None:
        return
    w, combined, direction, dots = made
    got = [combined[name] for name in trainable.names]
    want, again = weighted_reference(trainable, loss_fn, inputs, targets, w)
    random = trainable.call.draws is not None  # as check_norms: other draws look like a coupling (the safe side)
    raise_if_failed(verdict(trainable.names, got, want, trainable.dtype, again),
                    "a random combination of the per-sample gradients (formed without them)", strategy,
                    coupled=random, random=random, why=None if random else _WHY)
    if direction is not None and squared is not None:
        _screen(trainable, loss_fn, inputs, targets, strategy, squared, direction, dots)


def _screen(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object, strategy: str,
            squared: dict[str, torch.Tensor], direction: dict[str, torch.Tensor], dots: dict[str, torch.Tensor]
            ) -> None:
    """Every row's ``g_i . v`` against the derivative of sample i's loss alone along v (``vmap`` of ``jvp``), each
    parameter's part of v scaled by that parameter's typical norm; the worst row beyond the tolerance checked alone
    (:func:`~pergrad_viz.engine.certify.check_norms`). Nothing where forward mode cannot run the model."""
    names = trainable.names
    scale = dict(zip(names, direction_scale(torch.stack([squared[n].mean() for n in names])), strict=True))
    want = screened_jvp(trainable, loss_fn, inputs, targets, {n: direction[n] * scale[n].to(direction[n].dtype)
                                                              for n in names})
    if want is None:  # forward mode cannot run the model: the sample alone stays
        return
    want = want.double()
    zero = torch.zeros(inputs.size, dtype=torch.float64, device=trainable.device)
    got = sum((dots[n].double() * scale[n] if n in dots else zero for n in names), zero)
    size = torch.stack([squared[n] * scale[n].square() for n in names]).sum(0).sqrt()
    worst = worst_row((got - want).abs(), size, tolerance(trainable.dtype, trainable.device))
    if worst is not None:
        check_norms(trainable, loss_fn, inputs, targets, squared, strategy, worst)


_WHY = ("the samples interact in this model's forward in a way the probe of a few samples could not see (rows mixed "
        "only in larger batches, a batch statistic, code that depends on the batch size, a coupling in a custom "
        "backward), or a layer rule does not fit one of its layers")


# The trace kernel's every-row check takes two backward passes per output; above this many outputs a sample (a
# language model's logits) only one random entry is checked (:func:`check_ntk`).
TRACE_OUTPUTS = 16


def check_ntk_rows(trainable: Trainable, x1: Batch, x2: Batch | None, kernel: torch.Tensor, full: bool,
                   outputs: int) -> bool:
    """Every row of an NTK at once: with random u over x2's samples (and outputs, ``full``), ``K u`` from the result
    against ``J_1 v`` with ``v = J_2^T u``, both by plain reverse mode on each batch (v one backward of ``u . f``,
    then ``J_1 v`` its double backward; per output for the trace). A coupling between samples that the probe
    missed puts other samples' terms into the result's rows and shows here, as in :func:`check_combination`; one
    entry against the samples alone (:func:`check_ntk`) still covers the rest. Raise
    :class:`~pergrad_viz.errors.CheckFailedError` where a row differs beyond rounding (the size of its terms, ``|K|
    |u|``; in a precision below float64 a suspicion is settled against float64 copies, as the other checks do);
    False where the model has no double backward or the trace has too many outputs (then only that entry is
    checked), True where every row passed; the caller checks that entry either way."""
    if not full and outputs > TRACE_OUTPUTS:
        return False
    samples = (x1 if x2 is None else x2).size
    u = random_normal((samples, outputs) if full else (samples,), kernel)
    try:
        want = _kernel_times(trainable, x1, x2, u, full, outputs)
    except (RuntimeError, NotImplementedError):  # an operation without a double backward
        return False
    got, size = (torch.einsum("ijyz,jz->iy", kernel, u), torch.einsum("ijyz,jz->iy", kernel.abs(), u.abs())) if full \
        else (kernel @ u, kernel.abs() @ u.abs())
    size = size.double().reshape(x1.size, -1).norm(dim=1)
    size = torch.maximum(size, 1e-3 * size.max())
    tol = tolerance(trainable.dtype, trainable.device)
    off = _row_norms(got, want, x1.size)
    excess = off / (tol * size)
    if bool((excess <= 1).all()):
        return True
    if trainable.dtype != torch.float64:  # rounding: fail only rows 8x further from float64 than the reference is
        exact = _in_float64(trainable, x1, x2, u, full, outputs)
        if exact is None:
            excess = excess / 30
        else:
            off = _row_norms(got, exact, x1.size)
            excess = torch.where(off <= 8 * _row_norms(want, exact, x1.size), 0.0, off / (tol * size))
    worst = int(torch.nan_to_num(excess, nan=math.inf).argmax())
    if bool(excess[worst] <= 1):
        return True
    reason = (f"the per-call check found that row {worst} of the kernel times a random vector differs from the "
              f"definition, J_1 J_2^T u by plain autograd (difference {float(off[worst]):.2e} against terms of "
              f"{float(size[worst]):.2e})")
    raise CheckFailedError(f"{reason}: {_WHY}.", reason=reason, coupled=False)


def _kernel_times(trainable: Trainable, x1: Batch, x2: Batch | None, u: torch.Tensor, full: bool,
                  outputs: int) -> torch.Tensor:
    """``J_1 (J_2^T u)`` by reverse mode on the batches: (N1, Y) for ``full``, else (N1,) summed over the outputs."""
    other = x1 if x2 is None else x2
    if full:
        return _jacobian_times(trainable, x1, weighted_outputs(trainable, other, None, None, u))
    return sum(_jacobian_times(trainable, x1, weighted_outputs(trainable, other, None, None, _column(u, y, outputs)))[
        :, y] for y in range(outputs))


def _in_float64(trainable: Trainable, x1: Batch, x2: Batch | None, u: torch.Tensor, full: bool,
                outputs: int) -> torch.Tensor | None:
    """:func:`_kernel_times` on float64 copies of the model and the inputs; None where they cannot be had."""
    def compute(t: Trainable, x: Batch, _y: object, _f: object) -> list[torch.Tensor]:
        return [_kernel_times(t, x, None if x2 is None else x2.map(to_float64), u.double(), full, outputs)]

    try:
        exact = Float64Copies(trainable, x1, None, None).run(compute)
    except NotImplementedError:
        return None
    return None if exact is None else exact[0]


def _row_norms(a: torch.Tensor, b: torch.Tensor, rows: int) -> torch.Tensor:
    return (a.double() - b.double()).reshape(rows, -1).norm(dim=1)


def _jacobian_times(trainable: Trainable, x: Batch, direction: list[torch.Tensor]) -> torch.Tensor:
    """(N, Y): the Jacobian of every sample's outputs in the batch ``x`` times ``direction`` (per parameter), as the
    gradient with respect to output weights w of ``grad(w . f) . direction`` (reverse mode twice: the backward's own
    conventions, such as an Embedding's padding row, which forward mode does not share). NotImplementedError where a
    parameter's gradient has no graph of its own (a custom backward that detaches it: its terms would be lost)."""
    out = flat_outputs(trainable.outputs(x), x.size)
    w = torch.zeros_like(out, requires_grad=True)
    grads = torch.autograd.grad((out * w).sum(), trainable.params, create_graph=True, allow_unused=True)
    if any(g is not None and not g.requires_grad for g in grads):
        raise NotImplementedError("a gradient without a double backward")
    dot = sum((g * d).sum() for g, d in zip(grads, direction, strict=True) if g is not None)
    if not isinstance(dot, torch.Tensor):  # no parameter reached: J = 0
        return torch.zeros_like(out)
    times = torch.autograd.grad(dot, w, allow_unused=True)[0]
    return torch.zeros_like(out) if times is None else times


def _column(u: torch.Tensor, y: int, outputs: int) -> torch.Tensor:
    """(N, Y) weights: ``u`` (N,) on output y, zero elsewhere."""
    w = u.new_zeros(u.shape[0], outputs)
    w[:, y] = u
    return w


def _jacobian_alone(trainable: Trainable, x: Batch) -> torch.Tensor:
    """(Y, P): one sample's Jacobian by the definition, one backward per output."""
    output = trainable.outputs(x).reshape(-1)
    rows = []
    for j in range(output.numel()):
        grads = grad_of(output[j], trainable.params, retain_graph=True)
        rows.append(torch.cat([g.reshape(-1) for g in dense(grads, trainable.params)]))
    return torch.stack(rows)


def check_ntk(trainable: Trainable, x1: Batch, x2: Batch | None, kernel: torch.Tensor, full: bool) -> None:
    """Raise :class:`CheckFailedError` unless the block K[i, j] of ``kernel`` ((N1, N2, Y, Y) if ``full``, else
    (N1, N2)) for one random pair equals ``J_i J_j^T`` (or its trace) from the two samples computed alone."""
    i = draw(x1.size)
    other = x1 if x2 is None else x2
    j = draw(other.size)
    j1, j2 = _jacobian_alone(trainable, x1.sample(i)), _jacobian_alone(trainable, other.sample(j))
    check_output_count(f"sample {j} alone", j2.shape[0], j1.shape[0], f"sample {i} alone")
    check_output_count(f"sample {i} alone", j1.shape[0], kernel.shape[-1] if full else j1.shape[0], "the kernel")
    want = j1 @ j2.T if full else (j1 * j2).sum()
    diff = float((kernel[i, j].double() - want.double()).norm())
    scale = float(j1.double().norm() * j2.double().norm())
    if fails(diff, max(scale, 1e-300), tolerance(trainable.dtype, trainable.device)):
        reason = (f"the per-call check found that the kernel entry K[{i}, {j}] differs from J_{i} J_{j}^T computed "
                  f"from the two samples alone (difference {diff:.2e} against a scale of {scale:.2e})")
        raise CheckFailedError(f"{reason}: the model's forward does not keep the samples apart in a way the probe "
                               "could see.", reason=reason)
