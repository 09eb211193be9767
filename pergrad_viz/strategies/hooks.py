"""The ``hooks`` strategy: a thin client of the engine (:mod:`pergrad_viz.engine.capture`,
:mod:`pergrad_viz.engine.grouping`).

Forward hooks capture each layer's inputs and outputs; one backward pass gives the gradients with respect to the
layer outputs; per layer, a closed-form rule (``pergrad_viz.rules``) or, for a layer without one, the per-layer
fallback (``torch.func`` on that layer alone) turns both into per-sample parameter gradients.
"""

from __future__ import annotations

import torch

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.guards import check_reached
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.backward import loss_gradients, output_gradients
from pergrad_viz.engine.capture import describe
from pergrad_viz.engine.cotangents import has_fallback_layers, refuse_wrong_nesting
from pergrad_viz.engine.grouping import apply_rules
from pergrad_viz.strategies.outputs import check_batch_output_count

__all__ = ["describe", "grads", "jacobian", "jacobian_untried", "working_bytes"]  # describe: the explorer's


def working_bytes(chunk: int, num_params: int, largest_param: int, itemsize: int, outputs: int = 1) -> int:
    """Rules write into the result; a temporary of one parameter's per-sample size (a convolution's einsum, the
    per-layer fallback's vmap result, a tied parameter's second layer) at most."""
    return chunk * outputs * largest_param * itemsize


def grads(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
          out: dict[str, torch.Tensor]) -> None:
    """1 forward, 1 backward (to the layer outputs only), then the rules; writes (B, *param.shape)."""
    calls, g = loss_gradients(trainable, loss_fn, inputs, targets)
    check_reached(trainable, calls, "loss")
    apply_rules(trainable, calls, g, {n: t.unsqueeze(0) for n, t in out.items()})


def jacobian(trainable: Trainable, inputs: Batch, out: dict[str, torch.Tensor]) -> None:
    """1 forward, 1 backward batched over the Y outputs, then the rules; writes (B, Y, *param.shape)."""
    if has_fallback_layers(trainable, inputs):  # a vmap over the samples of a backward batched over the outputs
        refuse_wrong_nesting(trainable, inputs, "hooks", jacobian_untried, out)
    jacobian_untried(trainable, inputs, out)


def jacobian_untried(trainable: Trainable, inputs: Batch, out: dict[str, torch.Tensor]) -> None:
    """:func:`jacobian` without its trial of the per-layer fallback's nested ``vmap`` (engine.cotangents)."""
    calls, g, y_count = output_gradients(trainable, inputs)
    check_batch_output_count(y_count, out)
    check_reached(trainable, calls, "model output")
    apply_rules(trainable, calls, g, {n: t.transpose(0, 1) for n, t in out.items()})

