"""``torch.autograd.grad(..., is_grads_batched=True)`` with one-hot grad outputs.

The backward pass is vmapped over the one-hot vectors: B of them for per-sample gradients, B x Y for
output Jacobians. Each vmapped backward still runs over the whole batch, so the work grows like B^2
(a teaching strategy: it shows what ``is_grads_batched`` does, not the fastest way).
"""

from __future__ import annotations

import torch

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.guards import check_no_reentrant_checkpoint
from pergrad_viz.core.layout import flat_outputs
from pergrad_viz.core.losses import LossFn, per_sample_losses
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.strategies import loop
from pergrad_viz.strategies.outputs import (
    check_batch_output_count,
    check_some_take_part,
    mark_draws,
    refuse_reentrant_forward,
    write,
)


def working_bytes(chunk: int, num_params: int, largest_param: int, itemsize: int, outputs: int = 1) -> int:
    """The vmapped backward builds a chunk's result before the copy, and (chunk*Y)^2 one-hot grad outputs."""
    return (chunk * outputs * num_params + (chunk * outputs) ** 2) * itemsize


def grads(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
          out: dict[str, torch.Tensor]) -> None:
    """Writes (B, *param.shape) into ``out``: row i of the one-hot (B, B) picks the loss of sample i."""
    mark_draws(trainable, inputs)
    losses = per_sample_losses(loss_fn, inputs(trainable.model), targets)  # (B,)
    check_some_take_part(trainable, losses, inputs)
    check_no_reentrant_checkpoint([losses])  # its layers would get no gradient from autograd.grad
    one_hot = torch.eye(losses.shape[0], dtype=losses.dtype, device=losses.device)
    g = _batched_backward(losses, trainable.params, one_hot)
    if any(t is None for t in g):  # unused, or run inside a reentrant checkpoint on a no-grad input
        refuse_reentrant_forward(trainable, inputs.sample(0))
    write(out, trainable.names, g, slice(None))
    loop.recompute_non_finite_rows(trainable, loss_fn, inputs, targets, out)


def jacobian(trainable: Trainable, inputs: Batch, out: dict[str, torch.Tensor]) -> None:
    """Writes (B, Y, *param.shape) into ``out`` from B x Y one-hot grad outputs of shape (B, Y)."""
    outputs = flat_outputs(trainable.outputs(inputs), inputs.size)  # (B, Y)
    check_some_take_part(trainable, outputs, inputs, "model output")
    check_no_reentrant_checkpoint([outputs])
    batch, y_count = outputs.shape
    check_batch_output_count(y_count, out)
    one_hot = torch.eye(batch * y_count, dtype=outputs.dtype, device=outputs.device)
    g = _batched_backward(outputs, trainable.params, one_hot.view(-1, batch, y_count))
    g = [None if t is None else t.view(batch, y_count, *t.shape[1:]) for t in g]
    if any(t is None for t in g):
        refuse_reentrant_forward(trainable, inputs.sample(0))
    write(out, trainable.names, g, slice(None))
    loop.recompute_non_finite_rows(trainable, None, inputs, None, out)


def _batched_backward(output: torch.Tensor, params: tuple, one_hot: torch.Tensor) -> tuple:
    """``autograd.grad`` of ``output`` with the batched grad outputs ``one_hot`` (N, *output.shape): (N, *param.shape)
    each, None where unused. Where the backward has no batching rule (anomaly detection mode, a backward hook that
    reads a value: "Batching rule not implemented for aten::item"; sparse gradients, ``nn.Embedding(sparse=True)``),
    one backward per row, the same numbers (a sparse gradient made dense)."""
    if not torch.is_anomaly_enabled():  # which would report the batched attempt's failure as the model's error
        try:
            return torch.autograd.grad(output, params, grad_outputs=one_hot, is_grads_batched=True,
                                       allow_unused=True, retain_graph=True)  # kept for the fallback; freed with output
        except (RuntimeError, NotImplementedError) as e:
            if not any(cue in str(e) for cue in ("atching rule", "vmap", "Sparse")):
                raise
    rows = [torch.autograd.grad(output, params, grad_outputs=row, retain_graph=k < len(one_hot) - 1, allow_unused=True)
            for k, row in enumerate(one_hot)]
    return tuple(None if rows[0][k] is None else torch.stack([_dense(r[k]) for r in rows])
                 for k in range(len(params)))


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t.to_dense() if t.is_sparse else t

