"""``torch.func``: ``functional_call`` + ``vmap(grad)`` / ``vmap(jacrev)``.

The model is called as a pure function of its trainable parameters; frozen parameters and buffers are
passed along unchanged. Each sample is given to the model as a batch of one (``x.unsqueeze(0)``), so
the loss sees exactly what the loop gives it.
"""

from __future__ import annotations

import torch
from torch.func import functional_call, grad, jacrev, vmap

from ..losses import LossFn
from ..target import Target


def _trainable(target: Target) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in zip(target.names, target.params, strict=True)}


def grads(target: Target, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
          out: dict[str, torch.Tensor]) -> None:
    """Writes (B, *param.shape) into ``out`` with ``vmap(grad(loss of one sample))``."""
    frozen = target.frozen_state()

    def loss_of_one(params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        output = functional_call(target.model, {**params, **frozen}, (x.unsqueeze(0),))
        return loss_fn(output, y.unsqueeze(0))

    result = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(_trainable(target), inputs, targets)
    for name in target.names:
        out[name].copy_(result[name])


def jacobian(target: Target, inputs: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """Writes (B, Y, *param.shape) into ``out`` with ``vmap(jacrev(outputs of one sample))``."""
    frozen = target.frozen_state()

    def outputs_of_one(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(target.model, {**params, **frozen}, (x.unsqueeze(0),)).reshape(-1)

    result = vmap(jacrev(outputs_of_one), in_dims=(None, 0))(_trainable(target), inputs)
    for name in target.names:
        out[name].copy_(result[name])
