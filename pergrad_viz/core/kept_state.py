"""What a call keeps of the user's model to put it back (:func:`pergrad_viz.core.trainable.restoring_modes`): copies
of tensors' values, grouped so that a model of many buffers costs a few copies; whether a value changed although its
version counter did not (a write through ``.data``, a numpy view or the storage, or an op that does not count, such
as x86's fused quantisation observer); the hooks registered on the modules, so that hooks a forward (or a user's hook)
registers during the call are removed."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

# A module's hook registries: a key registered during a call is removed from each that holds it.
_HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
               "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")  # {key: hook} each


def has_user_hooks(named: Sequence[tuple[str, nn.Module]]) -> bool:
    """Whether a hook of the user's (a module's own or a global one, forward or backward) runs in the call."""
    if (module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks
            or module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for _, m in named)


def hook_keys(named: Sequence[tuple[str, nn.Module]]) -> list[tuple[int, ...]]:
    """Per module, the keys of its forward and backward hooks (the handles' ids) as the call found them."""
    return [(*m._forward_hooks, *m._forward_pre_hooks, *m._backward_hooks, *m._backward_pre_hooks)
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks else ()
            for _, m in named]


def remove_added_hooks(named: Sequence[tuple[str, nn.Module]], found: list[tuple[int, ...]]) -> None:
    """Remove the hooks registered since :func:`hook_keys` read ``found`` (a forward hook that registers another)."""
    for (_, m), keys in zip(named, found, strict=True):
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks:
            added = [k for name in _HOOKS for k, hook in getattr(m, name).items()
                     if k not in keys and not _packages(hook)]
            for attribute in _HOOK_DICTS:
                registry = getattr(m, attribute, None)
                for key in added:
                    if registry is not None and key in registry:
                        del registry[key]


def _packages(hook: object) -> bool:
    """Whether a hook is this package's own (the capture's, the probe's: they remove themselves)."""
    module = getattr(getattr(hook, "func", hook), "__module__", None) or ""
    return module.startswith("pergrad_viz.")


def copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each tensor's values: one ``torch.cat`` per dtype and device, each copy a view of it (ResNet-18's 60
    batch-norm buffers in 2 copies, not 60: on a GPU each is a kernel launch, every call)."""
    groups: dict[tuple, list[int]] = {}
    kept: list[torch.Tensor | None] = [None] * len(tensors)
    for k, t in enumerate(tensors):
        if t.layout is torch.strided and not t.is_quantized:
            groups.setdefault((t.dtype, t.device), []).append(k)
        else:
            kept[k] = t.detach().clone()
    for picked in groups.values():
        if len(picked) == 1:
            kept[picked[0]] = tensors[picked[0]].detach().clone()
            continue
        try:
            flat = torch.cat([tensors[k].detach().reshape(-1) for k in picked])
        except RuntimeError:  # a tensor that cannot be flattened (a nested one): one clone each
            for k in picked:
                kept[k] = tensors[k].detach().clone()
            continue
        for k, piece in zip(picked, flat.split([tensors[k].numel() for k in picked]), strict=True):
            kept[k] = piece.view(tensors[k].shape)
    return kept


_BITS = {torch.float64: torch.int64, torch.float32: torch.int32, torch.float16: torch.int16,
         torch.bfloat16: torch.int16}  # compared as bits: a NaN equals itself, -0.0 differs from 0.0


def values_changed(tensors: Sequence[torch.Tensor], kept: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor, whether its shape or values differ from its copy in ``kept`` (:func:`copies`): one comparison per
    dtype and device where none changed (the usual case), each tensor's where one did."""
    changed = [False] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for k, (t, c) in enumerate(zip(tensors, kept, strict=True)):
        if t.shape != c.shape:
            changed[k] = True
        elif t.layout is torch.strided and not t.is_quantized and not t.is_complex():
            groups.setdefault((t.dtype, t.device), []).append(k)
        else:
            changed[k] = not torch.equal(t, c)
    for (_, device), picked in groups.items():
        if device.type != "cpu" and len(picked) > 1:  # one comparison (one synchronisation) for the group first
            now = torch.cat([_bits(tensors[k]).reshape(-1) for k in picked])
            if torch.equal(now, torch.cat([_bits(kept[k]).reshape(-1) for k in picked])):
                continue
        for k in picked:  # on a CPU each alone: no copy of a large buffer made to compare it
            changed[k] = not torch.equal(_bits(tensors[k]), _bits(kept[k]))
    return changed


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view(_BITS[t.dtype]) if t.dtype in _BITS else t
