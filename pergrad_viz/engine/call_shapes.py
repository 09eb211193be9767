"""A layer's call in the hooked forward checked against its plan (:class:`~pergrad_viz.engine.plan.CallSpec`): as
often as in the probe, every tensor of the shape the probe saw with the batch dimension where it was; else
:class:`~pergrad_viz.errors.PlanMismatchError` (a forward whose behaviour depends on the data)."""

from __future__ import annotations

import functools

import torch
from torch import nn

from pergrad_viz.engine.plan import SHARED, CallSpec, LayerPlan
from pergrad_viz.errors import USE_AUTO, PlanMismatchError


def mismatch(module: nn.Module, name: str, why: str) -> PlanMismatchError:
    return PlanMismatchError(
        f"layer '{name or 'model'}' ({type(module).__name__}) {why} in this call, unlike in the probe of "
        "this model: its behaviour depends on the data, so the per-layer rules cannot be trusted. " + USE_AUTO
    )


def check_call(plan: LayerPlan, module: nn.Module, name: str, index: int, ins: list[torch.Tensor],
               outs: list[torch.Tensor], batch: int) -> CallSpec:
    """The plan's spec of the layer's call number ``index``, its tensors ``ins`` and ``outs`` checked against it."""
    specs = plan.calls
    if index >= len(specs):
        raise mismatch(module, name, f"is called more than {len(specs)} time(s)")
    spec = specs[index]
    want_ins, want_outs = _expected_shapes(spec, batch)
    if [t.shape for t in ins] == want_ins and [t.shape for t in outs] == want_outs:  # the common case: one compare
        return spec
    for tensors, want in ((ins, want_ins), (outs, want_outs)):
        if len(tensors) != len(want):
            raise mismatch(module, name, "has a different number of tensors")
        for t, shape in zip(tensors, want, strict=True):
            if t.shape != shape:
                raise mismatch(module, name, f"sees a tensor of shape {tuple(t.shape)} instead of {tuple(shape)}")
    return spec


@functools.lru_cache(maxsize=4096)
def _expected_shapes(spec: CallSpec, batch: int) -> tuple[list[torch.Size], list[torch.Size]]:
    """The shapes a call of ``spec`` has at batch size ``batch``: (inputs, outputs), each a list of ``torch.Size``
    (read only)."""
    def shapes(dims, rests):
        return [torch.Size(rest if d is SHARED else (*rest[:d], batch, *rest[d:])) for d, rest in zip(dims, rests,
                                                                                                       strict=True)]

    return shapes(spec.in_dims, spec.in_rest), shapes(spec.out_dims, spec.out_rest)
