"""One batched forward, then one ``torch.autograd.grad`` per scalar (per-sample loss, or per output
element) with ``retain_graph=True``, stacked into the result.

Samples do not interact (BatchNorm in training mode is refused), so the gradient of the loss of
sample i taken through the batched graph equals the gradient of that sample alone.
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
    """One scalar's gradients at a time, written straight into the result: nothing of result size."""
    return 0


def grads(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
          out: dict[str, torch.Tensor]) -> None:
    """1 forward, B backward passes through the batch graph; writes (B, *param.shape) into ``out``."""
    mark_draws(trainable, inputs)
    losses = per_sample_losses(loss_fn, inputs(trainable.model), targets)  # (B,)
    check_some_take_part(trainable, losses, inputs)
    check_no_reentrant_checkpoint([losses])  # its layers would get no gradient from autograd.grad
    batch = losses.shape[0]
    for i in range(batch):
        g = torch.autograd.grad(losses[i], trainable.params, retain_graph=i < batch - 1, allow_unused=True)
        if i == 0 and any(t is None for t in g):  # unused, or run inside a reentrant checkpoint on a no-grad input
            refuse_reentrant_forward(trainable, inputs.sample(0))
        write(out, trainable.names, g, i)
    loop.recompute_non_finite_rows(trainable, loss_fn, inputs, targets, out)


def jacobian(trainable: Trainable, inputs: Batch, out: dict[str, torch.Tensor]) -> None:
    """1 forward, B x Y backward passes; writes (B, Y, *param.shape) into ``out``."""
    outputs = flat_outputs(trainable.outputs(inputs), inputs.size)  # (B, Y)
    check_some_take_part(trainable, outputs, inputs, "model output")
    check_no_reentrant_checkpoint([outputs])
    batch, y_count = outputs.shape
    check_batch_output_count(y_count, out)
    for i in range(batch):
        for j in range(y_count):
            last = i == batch - 1 and j == y_count - 1
            g = torch.autograd.grad(outputs[i, j], trainable.params, retain_graph=not last, allow_unused=True)
            if i == j == 0 and any(t is None for t in g):
                refuse_reentrant_forward(trainable, inputs.sample(0))
            write(out, trainable.names, g, (i, j))
    loop.recompute_non_finite_rows(trainable, None, inputs, None, out)

