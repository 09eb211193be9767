"""``torch.func.functional_call`` on a model whose modules may be reached by several paths (one ``nn.Linear`` in two
containers, ``enc[0] is dec[2]``).

PyTorch's own call (torch 2.14), tying the paths of a tensor, swaps a shared module's attribute once per path and puts
them back in the same order, so that the module keeps the last replacement instead of its Parameter: the rest of that
call computes with a plain tensor (torch.func gave that parameter zero gradients) and the model is left without it.
Here each tensor is replaced once in each module that holds it (``tie_weights=False``, the ties spelled out): a
weight tied between two modules (GPT-2's embedding and output layer) in both, a shared module once."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.func import functional_call


def functional_call_once(module: nn.Module, values: Mapping[str, torch.Tensor], args: tuple | object,
                         kwargs: dict | None = None) -> object:
    """``module(*args, **kwargs)`` with the tensors ``values`` names (by any of their paths, {path: replacement})
    replaced in every module that holds them, each module once (``named_modules()`` yields a shared module once,
    under its first path)."""
    by_path: dict[str, int] = {}
    by_tensor: dict[int, list[str]] = {}
    for prefix, owner in module.named_modules():
        for attribute, tensor in (*owner._parameters.items(), *owner._buffers.items()):
            if tensor is not None:
                path = f"{prefix}.{attribute}" if prefix else attribute
                by_path[path] = id(tensor)
                by_tensor.setdefault(id(tensor), []).append(path)
    swapped = {}  # keyed by the walked paths: each module's attribute once
    for name, value in values.items():
        key = by_path[name] if name in by_path else _tensor_at(module, name)
        for path in by_tensor.get(key, (name,)):
            swapped[path] = value
    return functional_call(module, swapped, args, kwargs, tie_weights=False)


def _tensor_at(module: nn.Module, path: str) -> int | None:
    """id of the parameter or buffer at ``path`` (a second path of a shared module), or None where there is none."""
    prefix, _, attribute = path.rpartition(".")
    try:
        owner = module.get_submodule(prefix)
    except AttributeError:
        return None
    tensor = owner._parameters.get(attribute, owner._buffers.get(attribute))
    return None if tensor is None else id(tensor)
