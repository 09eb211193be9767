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
    outputs = flat_outputs(trainable.outputs(inputs))
    total = (outputs * w.to(outputs.dtype)).sum()
    return dense(grad_of(total, trainable.params), trainable.params)


def alone_grads(i: int) -> Callable[[Trainable, Batch, object, LossFn | None], Tensors]:
    """Sample i's gradient from a forward of sample i alone: the definition."""

    def compute(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn | None) -> Tensors:
        loss = scalar_loss(loss_fn(inputs.sample(i)(trainable.model), cut(targets, slice(i, i + 1), inputs.size)))
        return dense(grad_of(loss, trainable.params), trainable.params)

    return compute


def in_its_batch(draws: Draws, i: int, batch: int, like: torch.Tensor
                 ) -> Callable[[Trainable, Batch, object, LossFn | None], Tensors]:
    """Under ``randomness="different"``: sample i's gradient in its chunk's batched forward, the same draws again."""
    one_hot = torch.zeros(batch, dtype=like.dtype, device=like.device)
    one_hot[i] = 1

    def compute(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn | None) -> Tensors:
        return replayed_weighted_grads(draws, trainable, inputs, targets, loss_fn, one_hot)

    return compute


def alone_combination(i: int, u: torch.Tensor) -> Callable[[Trainable, Batch, object, LossFn | None], Tensors]:
    """The gradient of ``u . f(sample i alone)`` (u (Y,)): a random combination of sample i's Jacobian rows."""

    def compute(trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn | None) -> Tensors:
        output = trainable.outputs(inputs.sample(i)).reshape(-1)
        return dense(grad_of(output @ u.to(output.dtype), trainable.params), trainable.params)

    return compute
