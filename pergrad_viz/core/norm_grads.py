"""A workaround for a PyTorch bug on a batch of one: batch norm's backward (``nn.BatchNorm1d/2d/3d`` with running
statistics, ``nn.SyncBatchNorm`` in eval mode, and ``nn.InstanceNorm*``, which runs the same kernel) gives wrong
input, weight and bias gradients on CPUs (torch 2.14) when its input holds one sample and the gradient of its output
arrives with the strides of a channels-last tensor, as it does from ``x.flatten(2).transpose(1, 2)`` (the patch
embedding of XCiT and LeViT: a convolution, a BatchNorm2d, then tokens). The loop over samples, the check's sample
alone and any call on one sample are batches of one, so a correct batched result would be judged against a wrong
definition. During a forward pass of one sample, each such module's output gradient is made contiguous first (a
copy of one sample's activation), which the kernel computes correctly; the hooks are removed when the pass returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_KERNEL = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _on_output(module: nn.Module, args: tuple, output: object) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad and output.dim() >= 3 and output.shape[0] == 1:
        output.register_hook(_contiguous)


@contextlib.contextmanager
def contiguous_norm_grads(model: nn.Module) -> Iterator[None]:
    """For the duration of one forward pass of one sample: every batch-norm-kernel module's output gradient made
    contiguous before its backward reads it (see the module docstring)."""
    handles = [m.register_forward_hook(_on_output) for m in model.modules() if isinstance(m, _KERNEL)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
