"""The references the per-call check (``pergrad_viz.engine.certify``) compares results with, each computed by plain
autograd, independently of every strategy: the gradient of a weighted sum of the per-sample losses (or outputs) from
one batched forward and backward, a sample's gradient computed alone, and, under ``randomness="different"``
(``pergrad_viz.core.randomness``), the batched ones again from the random state each batched forward started from.

Shapes: B samples; every reference is a list of tensors shaped like the trainable parameters, in their order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.core.layout import flat_outputs
from pergrad_viz.core.losses import LossFn, per_sample_losses, scalar_loss
from pergrad_viz.core.randomness import Draws
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.rules.scaling import row_norms

Tensors = list[torch.Tensor]

def dense(grads: tuple[torch.Tensor | None, ...], params: tuple[torch.Tensor, ...]) -> Tensors:
    """One gradient per parameter, each dense: zeros where a parameter was not used, dense where it is sparse."""
    return [torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g
            for g, p in zip(grads, params, strict=True)]


def grad_of(output: torch.Tensor, params: tuple, **kw: object) -> tuple:
    """``autograd.grad`` with ``allow_unused``; None for every parameter where no trainable parameter reaches
    ``output`` (a sample alone the forward sends past them: zeros, as in the loop)."""
    if not output.requires_grad:
        return (None,) * len(params)
    return torch.autograd.grad(output, params, allow_unused=True, **kw)


def weighted_grads(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn | None,
                   w: torch.Tensor) -> Tensors:
    """The gradient of ``sum_i w_i L_i`` from one plain batched forward and backward: {parameter: its shape}."""
    losses = per_sample_losses(loss_fn, inputs(trainable.model), targets)
    total = (losses * w.to(losses.dtype)).sum()
    return dense(grad_of(total, trainable.params), trainable.params)


def replayed_weighted_grads(draws: Draws, trainable: Trainable, inputs: Batch, targets: object,
                            loss_fn: LossFn | None, w: torch.Tensor) -> Tensors:
    """Under ``randomness="different"``: the gradient of ``sum_i w_i L_i``, each chunk the strategy ran as one
    batched forward run again from the random state that forward started from (the same masks), summed over the
    chunks (a chunk whose weights are all 0 is skipped)."""
    total: Tensors | None = None
    for rows in draws.chunks():
        part = w[rows]
        if not bool(part.any()):
            continue
        whole = rows.stop - rows.start == inputs.size
        with draws.replaying(rows):
            grads = weighted_grads(trainable, inputs if whole else inputs.rows(rows),
                                   targets if whole else cut(targets, rows, inputs.size), loss_fn, part)
        total = grads if total is None else [a + b for a, b in zip(total, grads, strict=True)]
    if total is None:
        return [torch.zeros_like(p) for p in trainable.params]
    return total


def weighted_outputs(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn | None,
                     w: torch.Tensor) -> Tensors:
    """The gradient of ``sum_{i,y} W_iy f_iy`` from one plain batched forward and backward."""
    outputs = flat_outputs(trainable.outputs(inputs), inputs.size)
    total = (outputs * w.to(outputs.dtype)).sum()
    return dense(grad_of(total, trainable.params), trainable.params)


def alone_grads(i: int, in_batch: bool = False) -> Callable[[Trainable, Batch, object, LossFn | None], Tensors]:
    """Sample i's gradient from a forward of sample i alone: the definition (``in_batch``: from a forward of the
    whole batch, :func:`alone_loss`)."""

    loss_of = alone_loss(i, in_batch)

    def compute(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn | None) -> Tensors:
        return dense(grad_of(loss_of(trainable, inputs, targets, loss_fn), trainable.params), trainable.params)

    return compute


def alone_combination(i: int, u: torch.Tensor, in_batch: bool = False
                      ) -> Callable[[Trainable, Batch, object, LossFn | None], Tensors]:
    """The gradient of ``u . f(sample i alone)`` (u (Y,)): a random combination of sample i's Jacobian rows
    (``in_batch``: of row i of the whole batch's flat outputs (B, Y))."""

    def compute(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn | None) -> Tensors:
        if in_batch:
            output = flat_outputs(trainable.outputs(inputs), inputs.size)[i]
        else:
            output = trainable.outputs(inputs.sample(i)).reshape(-1)
        return dense(grad_of(output @ u.to(output.dtype), trainable.params), trainable.params)

    return compute


def alone_loss(i: int, in_batch: bool = False) -> Callable[[Trainable, Batch, object, LossFn], torch.Tensor]:
    """The scalar loss of sample i run alone: the definition. ``in_batch``: sample i's loss from a forward of the
    whole batch instead, the kernels the batch ran (the definition where the samples do not interact, up to the
    rounding of those kernels, which the per-call check allows for)."""

    def compute(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn) -> torch.Tensor:
        if in_batch:
            return per_sample_losses(loss_fn, inputs(trainable.model), targets)[i]
        return scalar_loss(loss_fn(inputs.sample(i)(trainable.model), cut(targets, slice(i, i + 1), inputs.size)))

    return compute


def in_its_batch_loss(draws: Draws, i: int) -> Callable[[Trainable, Batch, object, LossFn], torch.Tensor]:
    """Under ``randomness="different"``: sample i's loss in its chunk's batched forward, the same draws again."""

    def compute(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn) -> torch.Tensor:
        rows = draws.chunk_of(i)
        whole = rows.stop - rows.start == inputs.size
        with draws.replaying(rows):
            output = (inputs if whole else inputs.rows(rows))(trainable.model)
        losses = per_sample_losses(loss_fn, output, targets if whole else cut(targets, rows, inputs.size))
        return losses[i - rows.start]

    return compute


def norms_of_grads(total: torch.Tensor, params: tuple[torch.Tensor, ...]) -> Tensors:
    """[(1,) the L2 norm of d total / d p for each p of ``params``] from one backward, each parameter's gradient
    reduced to its norm by a hook as autograd makes it and handed back as a zero that holds no memory: no more than
    one parameter's gradient is alive at once (the check of a clipped sum runs while the sums, P numbers, are). The
    hooks are removed before it returns."""
    norms: Tensors = [torch.zeros(1, dtype=p.dtype, device=p.device) for p in params]
    if not total.requires_grad:
        return norms

    def hook_for(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(g: torch.Tensor) -> torch.Tensor:
            norms[k] = row_norms((g.to_dense() if g.is_sparse else g).reshape(1, -1))  # no overflow in the squares
            return g if g.is_sparse else g.new_zeros(()).expand(g.shape)

        return hook

    handles = [p.register_hook(hook_for(k)) for k, p in enumerate(params)]
    try:
        torch.autograd.grad(total, params, allow_unused=True)
    finally:
        for handle in handles:
            handle.remove()
    return norms
