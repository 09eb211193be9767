"""What a call works on: the model's trainable parameters, checks of the model's modes, the guard
that leaves the user's model as it was found."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from .errors import UnsupportedModelError

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_RANDOM_IN_TRAINING = (*_DROPOUT, nn.RReLU)  # draw random numbers on every forward in training mode


@dataclass(frozen=True)
class Trainable:
    """A model and its trainable parameters, in ``named_parameters()`` order."""

    model: nn.Module
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    modules: tuple[tuple[str, nn.Module], ...]  # named_modules(), walked once per call
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # scratch space for one call

    @classmethod
    def of(cls, model: nn.Module) -> Trainable:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(
                "the model has no trainable parameters (none with requires_grad=True): there is nothing "
                "to differentiate; unfreeze some with p.requires_grad_(True)"
            )
        names, params = zip(*named, strict=True)
        return cls(model, tuple(names), tuple(params), tuple(model.named_modules()))

    @property
    def shapes(self) -> dict[str, torch.Size]:
        return {n: p.shape for n, p in zip(self.names, self.params, strict=True)}

    @property
    def num_params(self) -> int:
        """P, the number of trainable scalars."""
        return sum(p.numel() for p in self.params)

    @property
    def largest_param(self) -> int:
        """The number of elements of the largest trainable parameter."""
        return max(p.numel() for p in self.params)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def frozen_state(self) -> dict[str, torch.Tensor]:
        """Frozen parameters and buffers, by name, for ``torch.func.functional_call``."""
        trainable = set(self.names)
        state = {n: p for n, p in self.model.named_parameters() if n not in trainable}
        state.update(dict(self.model.named_buffers()))
        return state


def check_modes(model: nn.Module | Trainable) -> None:
    """Refuse layers whose per-sample gradients are undefined or random in the model's current mode.

    BatchNorm that uses batch statistics mixes the samples of a batch, so "the gradient of sample i"
    depends on the other samples; Dropout in training mode draws different masks in each strategy.
    """
    for name, m in model.modules if isinstance(model, Trainable) else model.named_modules():
        label = f"{name or 'model'} ({type(m).__name__})"
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
            raise UnsupportedModelError(
                f"{label} normalises with batch statistics, which mixes the samples of a batch, so "
                "per-sample gradients are not defined. Call model.eval() to use the running statistics, "
                "or use GroupNorm / LayerNorm instead of BatchNorm."
            )
        if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.training and m.track_running_stats:
            raise UnsupportedModelError(
                f"{label} has track_running_stats=True in training mode: every forward pass would update its "
                "running statistics, so computing per-sample gradients would change your model. Call model.eval() "
                "or create it with track_running_stats=False."
            )
        internal_dropout = (isinstance(m, nn.MultiheadAttention) and m.dropout > 0) or (
            isinstance(m, nn.RNNBase) and m.dropout > 0 and m.num_layers > 1)
        if internal_dropout and m.training:
            raise UnsupportedModelError(
                f"{label} applies dropout={m.dropout} in training mode: it would draw different random masks in each "
                "strategy and each sample, so results would be random and not comparable. Call model.eval() (or "
                "create it with dropout=0) before computing per-sample gradients."
            )
        if isinstance(m, _RANDOM_IN_TRAINING) and m.training and getattr(m, "p", 1) > 0:
            raise UnsupportedModelError(
                f"{label} is in training mode: it would draw different random numbers (masks, slopes) in each strategy "
                "and each sample, so results would be random and not comparable. Call model.eval() "
                "(or set p=0) before computing per-sample gradients."
            )
        if isinstance(m, nn.Embedding) and m.max_norm is not None:
            raise UnsupportedModelError(
                f"{label} has max_norm={m.max_norm}, which rewrites its weight in place on every forward "
                "pass; per-sample gradients would change your model. Renormalise once yourself and "
                "create the Embedding with max_norm=None."
            )
        if isinstance(m, nn.Embedding) and m.scale_grad_by_freq:
            raise UnsupportedModelError(
                f"{label} has scale_grad_by_freq=True, which scales each token's gradient by its count in the "
                "whole batch, so the gradient of one sample would depend on the other samples. Create the "
                "Embedding with scale_grad_by_freq=False."
            )


def hooked_parameter(trainable: Trainable) -> str | None:
    """The name of a trainable parameter with a gradient hook (``p.register_hook``), if any: ``torch.autograd.grad``
    (the loop) applies such hooks; the batched strategies compute the plain gradient and cannot."""
    return next((n for n, p in zip(trainable.names, trainable.params, strict=True) if p._backward_hooks), None)


@contextlib.contextmanager
def restoring_modes(model: nn.Module | Trainable) -> Iterator[None]:
    """Leave ``model`` as it was found: every module's training flag is restored, even on error.

    Strategies never call ``backward()`` (so ``.grad`` is untouched) and remove their own hooks.
    """
    modules = (m for _, m in model.modules) if isinstance(model, Trainable) else model.modules()
    flags = [(m, m.training) for m in modules]
    try:
        yield
    finally:
        for m, flag in flags:
            if m.training != flag:
                m.training = flag
