"""A workaround for a PyTorch bug on a batch of one: batch norm's backward (``nn.BatchNorm1d/2d/3d`` with running
statistics, ``nn.SyncBatchNorm`` in eval mode, and ``nn.InstanceNorm*``, which runs the same kernel) gives wrong
input, weight and bias gradients on CPUs (torch 2.14) when its input holds one sample and the gradient of its output
arrives in another memory layout than its input's: channels-last strides for a contiguous input, as from
``x.flatten(2).transpose(1, 2)`` (the patch embedding of XCiT and LeViT: a convolution, a BatchNorm2d, then tokens),
or contiguous ones for a channels_last input (a channels_last image through a convolution, the hooked pass's alias
of the output in between). The loop over samples, the check's sample
alone and any call on one sample are batches of one, so a correct batched result would be judged against a wrong
definition. During a forward pass of one sample, each such module's output gradient is laid out as its input is
first (a copy of one sample's activation), which the kernel computes correctly; the hooks are removed when the pass
returns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_KERNEL = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def _layout_of(t: object) -> torch.memory_format:
    """The memory format a batch-norm kernel reads its input in: channels-last where the input is laid out so (a
    convolution's output on a channels_last image), else contiguous."""
    if isinstance(t, torch.Tensor) and not t.is_contiguous():
        for dim, fmt in ((4, torch.channels_last), (5, torch.channels_last_3d)):
            if t.dim() == dim and t.is_contiguous(memory_format=fmt):
                return fmt
    return torch.contiguous_format


def _on_output(module: nn.Module, args: tuple, output: object) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad and output.dim() >= 3 and output.shape[0] == 1:
        layout = _layout_of(args[0] if args else None)
        output.register_hook(lambda grad: grad.contiguous(memory_format=layout))


@contextlib.contextmanager
def contiguous_norm_grads(model: nn.Module) -> Iterator[None]:
    """For the duration of one forward pass of one sample: every batch-norm-kernel module's output gradient made
    contiguous before its backward reads it (see the module docstring)."""
    # prepend: on the module's own output, before any hook (the hooked pass's alias) hands another downstream
    handles = [m.register_forward_hook(_on_output, prepend=True) for m in model.modules() if isinstance(m, _KERNEL)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
