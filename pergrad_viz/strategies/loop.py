"""The baseline: a Python loop over samples (and outputs), one ``torch.autograd.grad`` each.

This is the definition every other strategy is checked against: the gradient of sample i is the
gradient of ``loss_fn(model(x[i:i+1]), y[i:i+1])``.
"""

from __future__ import annotations

import torch

from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.core.guards import check_no_reentrant_checkpoint, check_output_count
from pergrad_viz.core.losses import LossFn, scalar_loss
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.observe import stale_error
from pergrad_viz.strategies.outputs import (
    non_finite_rows,
    nothing_took_part,
    refuse_random_forward,
    refuse_reentrant_forward,
    write,
)


def working_bytes(chunk: int, num_params: int, largest_param: int, itemsize: int, outputs: int = 1) -> int:
    """One sample's gradients at a time, written straight into the result: nothing of result size."""
    return 0


def grads(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
          out: dict[str, torch.Tensor]) -> None:
    """B forward and B backward passes of one sample each; writes (B, *param.shape) into ``out``."""
    refuse_random_forward(trainable, inputs)
    unused = [None] * len(trainable.params)
    took_part, walked = False, False
    for i in range(inputs.size):
        loss = scalar_loss(loss_fn(inputs.sample(i)(trainable.model), cut(targets, slice(i, i + 1), inputs.size)))
        took_part |= loss.requires_grad  # a sample no trainable parameter reaches: zeros (allow_unused)
        g = _grad(loss, trainable.params) if loss.requires_grad else unused
        if loss.requires_grad and not walked and any(t is None for t in g):
            check_no_reentrant_checkpoint([loss])  # unused, or recomputed only by .backward(): zeros here
            refuse_reentrant_forward(trainable, inputs.sample(i))
            walked = True
        write(out, trainable.names, g, i)
    if not took_part:
        raise nothing_took_part(trainable, inputs)  # a reentrant checkpoint on no-grad inputs: named


def _grad(output: torch.Tensor, params: tuple[torch.Tensor, ...], retain_graph: bool = False) -> tuple:
    """``torch.autograd.grad`` of one sample's ``output``; a graph an earlier sample's backward freed (a tensor kept
    across forward passes: ``parametrize.cached()``) refused as the batched strategies refuse it."""
    try:
        return torch.autograd.grad(output, params, retain_graph=retain_graph, allow_unused=True)
    except RuntimeError as e:
        if "backward through the graph a second time" in str(e):
            raise stale_error(None) from e
        raise


def jacobian(trainable: Trainable, inputs: Batch, out: dict[str, torch.Tensor]) -> None:
    """B forward and B x Y backward passes; writes (B, Y, *param.shape) into ``out``."""
    refuse_random_forward(trainable, inputs)
    unused = [None] * len(trainable.params)
    took_part, walked = False, False
    wanted = next(iter(out.values())).shape[1] if out else None  # Y, read from sample 0 (api.output_size)
    for i in range(inputs.size):
        output = trainable.outputs(inputs.sample(i)).reshape(-1)
        y_count = output.numel()
        if wanted is not None:
            check_output_count("another sample alone", y_count, wanted)  # (i counts within a chunk)
        took_part |= output.requires_grad
        for j in range(y_count):
            g = _grad(output[j], trainable.params, retain_graph=j < y_count - 1) if output.requires_grad else unused
            if output.requires_grad and not walked and any(t is None for t in g):
                check_no_reentrant_checkpoint([output])
                refuse_reentrant_forward(trainable, inputs.sample(i))
                walked = True
            write(out, trainable.names, g, (i, j))
    if not took_part and inputs.size:
        raise nothing_took_part(trainable, inputs, "model output")


def recompute_non_finite_rows(trainable: Trainable, loss_fn: LossFn | None, inputs: Batch, targets: object,
                              out: dict[str, torch.Tensor]) -> None:
    """Rows of a batched strategy's ``out`` {name: (B, ...)} that came out non-finite, recomputed here for their
    sample alone (``loss_fn`` None: Jacobians): a non-finite sample (an inf input, an overflow) must not spread into
    the other samples' rows through the batched backward's weight products."""
    for i in non_finite_rows(out):
        rows = {n: t[i:i + 1] for n, t in out.items()}
        if loss_fn is None:
            jacobian(trainable, inputs.sample(i), rows)
        else:
            grads(trainable, loss_fn, inputs.sample(i), cut(targets, slice(i, i + 1), inputs.size), rows)
