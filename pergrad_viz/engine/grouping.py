"""After the capture (:mod:`pergrad_viz.engine.capture`): the captured calls grouped by layer, the layers' rules
applied to them (a closed-form rule, a call rule or the per-layer fallback), summed over repeated calls of a shared
layer and over the layers sharing (tying) a parameter."""

from __future__ import annotations

import functools
import inspect
from collections import Counter
from collections.abc import Sequence

import torch
from torch import nn

from pergrad_viz.core.ownership import tied
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.capture import Call, Layer
from pergrad_viz.engine.plan import LayerKind
from pergrad_viz.rules import call_rule_for
from pergrad_viz.rules.fallback import per_sample_vjp


@functools.cache
def _signature(module_type: type[nn.Module]) -> inspect.Signature:
    """The signature of a layer type's forward, self first (a "call" layer runs its type's forward)."""
    return inspect.signature(module_type.forward)


@torch.no_grad()  # numbers only: a replayed layer's other parameters must not put the result on the graph
def call_grads(call: Call, grads: list, out: dict[str, torch.Tensor]) -> None:
    """One call's per-sample gradients of its layer's parameters into ``out`` {local name: (N, B, *shape)}."""
    layer = call.layer
    n = next(iter(out.values())).shape[0]
    if all(g is None for g in grads):  # this call does not reach the output
        for t in out.values():
            t.zero_()
        return
    grads, captured_grads = grads[:len(call.outputs)], grads[len(call.outputs):]
    if layer.kind is LayerKind.RULE:
        layer.rule(layer.module, call.activation, call.rule_grad(grads[0]), out)
        return
    if layer.kind is LayerKind.BROADCAST:  # the gradients at the per-sample copies (N, B, *rest), in local order
        for ln, g in zip(layer.local, grads, strict=True):
            if g is None:
                out[ln].zero_()
            else:
                out[ln].copy_(g.reshape(out[ln].shape))
        return
    full = [g if g is not None else None if not (o.is_floating_point() or o.is_complex())  # integer outputs: none
            else torch.zeros(n, *o.shape, dtype=o.dtype, device=o.device)
            for g, o in zip(grads, call.outputs, strict=True)]
    if layer.kind is LayerKind.CALL:
        args, kwargs = call.inputs
        if kwargs:  # e.g. lstm(x, hx=h): the rule takes every argument in the order of forward's signature
            bound = _signature(type(layer.module)).bind(layer.module, *args, **kwargs)
            bound.apply_defaults()
            args = tuple(bound.arguments.values())[1:]
        rule = call_rule_for(layer.module)
        try:
            if rule.capture is None:
                rule(layer.module, args, full, out)
            else:
                rule(layer.module, args, full, out, call.captured, captured_grads)
            return
        except NotImplementedError:  # a configuration the closed form does not cover: this layer's fallback
            pass
    per_sample_vjp(layer.module, call.inputs, call.spec.in_dims, full, call.spec.out_dims, out)


def apply_rules(trainable: Trainable, calls: list[Call], grads: list[list], out: dict[str, torch.Tensor]) -> None:
    """``out[name]`` is (N, B, *param.shape) here; sums over repeated calls of a shared layer, and over
    modules that share (tie) a parameter."""
    uses = Counter(fn for c in calls for fn in c.layer.local.values())
    written: set[str] = set()
    for call, g in zip(calls, grads, strict=True):
        local = call.layer.local
        if all(uses[fn] == 1 for fn in local.values()):
            call_grads(call, g, {ln: out[fn] for ln, fn in local.items()})
            written.update(local.values())
            continue
        tmp = {ln: torch.empty_like(out[fn]) for ln, fn in local.items()}
        call_grads(call, g, tmp)
        for ln, fn in local.items():
            if fn in written:
                out[fn].add_(tmp[ln])
            else:
                out[fn].copy_(tmp[ln])
                written.add(fn)
    for name in trainable.names:
        if name not in written:  # a parameter the forward pass never used
            out[name].zero_()


# What one layer's calls saw: per call, the call and its output gradients (each (N, *output.shape) or None).
Seen = list[tuple[Call, list]]


def group_calls(calls: Sequence[Call], grads: Sequence[list]) -> dict[int, tuple[Layer, Seen]]:
    """Calls that reach the output, grouped by layer: {id(module): (layer, [(call, grads)])}."""
    grouped: dict[int, tuple[Layer, Seen]] = {}
    for call, g in zip(calls, grads, strict=True):
        if all(t is None for t in g):  # this call does not reach the output: it contributes nothing
            continue
        grouped.setdefault(id(call.layer.module), (call.layer, []))[1].append((call, g))
    return grouped


def tied_names(calls: Sequence[Call]) -> set[str]:
    """Full names of the parameters that more than one layer handles (tied weights)."""
    layers = {id(c.layer.module): c.layer for c in calls}
    return tied(layer.local for layer in layers.values())


def _empty_like_params(layer: Layer, n: int, batch: int, like: torch.Tensor) -> dict[str, torch.Tensor]:
    module = layer.module
    own = module._parameters  # a module's own parameters without get_parameter's path walk (a child's: with it)
    return {ln: torch.empty(n, batch, *(own[ln] if ln in own else module.get_parameter(ln)).shape, dtype=like.dtype,
                            device=like.device) for ln in layer.local}


def dense_grads(layer: Layer, seen: Seen) -> dict[str, torch.Tensor]:
    """One layer's per-sample gradients, summed over calls: {local name: (N, B, *param.shape)}."""
    total: dict[str, torch.Tensor] = {}
    for call, gs in seen:
        g = next(t for t in gs if t is not None)
        n = g.shape[0]
        batch = call.outputs[0].shape[call.spec.out_dims[0]] if call.spec.out_dims[0] is not None else 0
        out = _empty_like_params(layer, n, batch, g)
        call_grads(call, gs, out)
        for ln, t in out.items():
            total[ln] = t if ln not in total else total[ln].add_(t)
    return total
