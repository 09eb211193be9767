"""Float64 copies of a model and its inputs: where a comparison in a lower precision is in doubt (a per-call check,
the probe), the same computation on a float64 copy settles whether a difference is rounding."""

from __future__ import annotations

import copy

import torch
from torch.utils._pytree import tree_map

from pergrad_viz.core.trainable import Trainable


def below_float64(dtype: torch.dtype) -> bool:
    """Whether values in ``dtype`` carry less precision than float64 (float32, TF32 on CUDA, half precision)."""
    return dtype not in (torch.float64, torch.complex128)


def float64_copy(trainable: Trainable) -> Trainable | None:
    """A float64 copy of the model as a :class:`Trainable` with the same names; None where it cannot be made."""
    try:
        model = copy.deepcopy(trainable.model).double()
    except Exception:  # a model that cannot be copied: the caller decides without float64
        return None
    params = dict(model.named_parameters())
    if any(n not in params for n in trainable.names):
        return None
    return Trainable(model, trainable.names, tuple(params[n] for n in trainable.names), tuple(model.named_modules()),
                     select=trainable.select, named_parameters=tuple(model.named_parameters()))


def to_float64(obj: object) -> object:
    """``obj`` (a tensor or a pytree of them) with every floating-point tensor in float64."""
    return tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t, obj)
