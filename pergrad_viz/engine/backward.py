"""The backward half of the hooks strategy: after the hooked forward (:mod:`pergrad_viz.engine.capture`), one
backward pass to the captured layer outputs only: of the summed per-sample losses (gradients), or batched over the Y
one-hot output vectors (Jacobians: each vector selects output j of every sample at once, since samples do not
interact). Per call, per output tensor, the gradient at that output or None."""

from __future__ import annotations

import torch

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.guards import check_takes_part
from pergrad_viz.core.layout import flat_outputs
from pergrad_viz.core.loss_reads import loss_of_output
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.capture import Call, capture
from pergrad_viz.engine.unplanned import refuse_outside_uses, refuse_unplanned, unplanned


def backward_to_layers(trainable: Trainable, calls: list[Call], total: torch.Tensor) -> list[list]:
    """The gradients of the scalar ``total`` with respect to every captured layer output (1 backward pass, to the
    layer outputs only; :mod:`~pergrad_viz.engine.unplanned` checked): per call, per output, (1, *shape) or None."""
    check_takes_part(trainable, total)  # a loss_fn that detaches its result
    refuse_outside_uses(trainable, calls, [total.grad_fn])
    tensors, where = _grad_targets(calls)
    names, extra = unplanned(trainable)
    if not tensors + extra:  # the loss reads a parameter only itself: the hooks' caller hands over
        return _regroup(calls, [], (), batched=False)
    grads = torch.autograd.grad(total, tensors + extra, allow_unused=True)
    refuse_unplanned(trainable, names, grads[len(tensors):])
    return _regroup(calls, where, grads[:len(tensors)], batched=False)


def _grad_targets(calls: list[Call]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """The output tensors (then the captured internals) that carry gradients, and (call index, index) for each."""
    tensors, where = [], []
    for i, call in enumerate(calls):
        for k, t in enumerate(call.outputs + call.internals):
            if t.requires_grad:
                tensors.append(t)
                where.append((i, k))
    return tensors, where


def _regroup(calls: list[Call], where: list[tuple[int, int]], grads: tuple, batched: bool) -> list[list]:
    """Per call, per output leaf (then per captured internal): (N, *leaf.shape) gradients (or None)."""
    per_call: list[list] = [[None] * (len(c.outputs) + len(c.internals)) for c in calls]
    for (i, k), g in zip(where, grads, strict=True):
        if g is not None:
            per_call[i][k] = g if batched else g.unsqueeze(0)
    return per_call


def loss_gradients(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object
                   ) -> tuple[list[Call], list[list]]:
    """1 forward with hooks, 1 backward of the summed per-sample losses to the layer outputs only. Returns (calls,
    grads): per call, per output tensor, a (1, *output.shape) gradient or None."""
    output, calls = capture(trainable, inputs)
    if not any(t.requires_grad for c in calls for t in c.outputs):  # no layer with trainable parameters reached
        return calls, _regroup(calls, [], (), batched=False)
    return calls, backward_to_layers(trainable, calls, loss_of_output(trainable, loss_fn, output, targets))


def output_gradients(trainable: Trainable, inputs: Batch) -> tuple[list[Call], list[list], int]:
    """1 forward with hooks, 1 backward batched over the Y one-hot output vectors to the layer outputs.

    Returns (calls, grads, Y): per call, per output tensor, a (Y, *output.shape) gradient or None.
    """
    output, calls = capture(trainable, inputs)
    outputs = flat_outputs(output if trainable.select is None else trainable.select(output), inputs.size)  # (B, Y)
    check_takes_part(trainable, outputs, "model output")  # output=lambda out: out.detach()
    batch, y_count = outputs.shape
    tensors, where = _grad_targets(calls)
    refuse_outside_uses(trainable, calls, [outputs.grad_fn])
    names, extra = unplanned(trainable) if outputs.requires_grad else ([], [])
    if not tensors and not extra:
        return calls, _regroup(calls, [], (), batched=True), y_count
    one_hot = torch.eye(y_count, dtype=outputs.dtype, device=outputs.device).unsqueeze(1).expand(-1, batch, -1)
    asked = tensors + extra
    grads = None
    if not torch.is_anomaly_enabled():  # anomaly mode has no batching rule (and would report the attempt's failure)
        try:
            grads = torch.autograd.grad(outputs, asked, grad_outputs=one_hot, is_grads_batched=True,
                                        allow_unused=True, retain_graph=True)
        except (RuntimeError, NotImplementedError):  # a backward without a batching rule: one output at a time
            pass
    if grads is None:
        rows = [torch.autograd.grad(outputs, asked, grad_outputs=one_hot[j], allow_unused=True,
                                    retain_graph=True) for j in range(y_count)]
        grads = tuple(None if rows[0][k] is None else torch.stack([r[k] for r in rows]) for k in range(len(asked)))
    refuse_unplanned(trainable, names, grads[len(tensors):])
    return calls, _regroup(calls, where, grads[:len(tensors)], batched=True), y_count
