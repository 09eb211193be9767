"""What a call keeps of the user's model to put it back (:func:`pergrad_viz.core.trainable.restoring_modes`): copies
of tensors' values, grouped so that a model of many buffers costs a few copies; whether a value changed although its
version counter did not (a write through ``.data``, a numpy view or the storage, or an op that does not count, such
as x86's fused quantisation observer); whether a hook of the user's runs (then every module's attributes are kept).
Hooks a forward registers during a call are left (another thread of the user's may register one meanwhile), and with
them the plain values the forward added as attributes (the mark that they are installed)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules import module as module_hooks


def has_user_hooks(named: Sequence[tuple[str, nn.Module]]) -> bool:
    """Whether a hook of the user's (a module's own or a global one, forward or backward) runs in the call."""
    if (module_hooks._global_forward_hooks or module_hooks._global_forward_pre_hooks
            or module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
               for _, m in named)


def hooks_since(named: Sequence[tuple[str, nn.Module]], first: int) -> bool:
    """Whether a hook registered since handle number ``first`` (``RemovableHandle.next_id`` then) is on a module: a
    forward that installs hooks of its own once and marks the model so (Hugging Face's output capturing sets
    ``_output_capturing_hooks_installed``), whose mark is then kept with the hooks."""
    return any(k >= first for _, m in named
               for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks, m._backward_pre_hooks)
               for k in hooks)


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


# Buffers up to this size are compared by value after a call (a write through ``.data`` or numpy counts no version);
# larger ones (a frozen embedding table kept as a buffer) by their version alone: their copy costs enough already.
VALUE_COMPARED_BYTES = 16 << 20


def values_changed(tensors: Sequence[torch.Tensor], kept: Sequence[torch.Tensor]) -> list[bool]:
    """Per tensor, whether its shape or values differ from its copy in ``kept`` (:func:`copies`), compared as bytes
    (a NaN equals itself, -0.0 differs from 0.0): on a GPU one comparison per dtype and device where none changed
    (the usual case), each tensor's where one did. Sparse and quantised tensors, and those over
    :data:`VALUE_COMPARED_BYTES`, by their shape alone (their versions are read by the caller)."""
    changed = [False] * len(tensors)
    groups: dict[tuple, list[int]] = {}
    for k, (t, c) in enumerate(zip(tensors, kept, strict=True)):
        if t.shape != c.shape:
            changed[k] = True
        elif (t.layout is torch.strided and not t.is_quantized and not t.is_meta
              and t.numel() * t.element_size() <= VALUE_COMPARED_BYTES):
            groups.setdefault((t.dtype, t.device), []).append(k)
    for (_, device), picked in groups.items():
        if device.type != "cpu" and len(picked) > 1:  # one comparison (one synchronisation) for the group first
            now = torch.cat([_bits(tensors[k]) for k in picked])
            if torch.equal(now, torch.cat([_bits(kept[k]) for k in picked])):
                continue
        for k in picked:  # on a CPU each alone: no copy of a large buffer made to compare it
            changed[k] = not torch.equal(_bits(tensors[k]), _bits(kept[k]))
    return changed


def same_values(new: object, old: object) -> bool:
    """Whether ``new`` (a buffer a forward registered again) holds what ``old`` held: the same shape, dtype, device and
    values (a NaN equals itself); sparse, quantised and meta tensors never (Hugging Face's dynamic RoPE registers its
    ``inv_freq`` again on every forward below its longest length, the same values)."""
    if new is old:
        return True
    if not (isinstance(new, torch.Tensor) and isinstance(old, torch.Tensor)) or any(
            t.is_meta or t.layout != torch.strided or t.is_quantized for t in (new, old)):
        return False
    if (new.shape, new.dtype, new.device) != (old.shape, old.dtype, old.device):
        return False
    return torch.equal(new, old) or torch.equal(_bits(new), _bits(old))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (1-D, uint8), whatever its dtype (complex, float8, bool too) and strides (a view)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)
