"""The per-layer fallback: per-sample gradients of one layer without a closed-form rule, from ``torch.func``.

For a layer call that saw inputs ``xs`` and whose outputs got the gradients ``gs`` (one row per sample along
each tensor's batch dimension), the per-sample gradient of sample b is the vector-Jacobian product of the
layer *alone*, run on sample b's inputs (a batch of one), with sample b's output gradients. That is
``vmap`` over the samples of ``vjp(functional_call(layer, params, sample))``, and ``vmap`` over the N
gradient rows (N = Y for Jacobians) of the vjp function. The rest of the model stays on its rules.

Where PyTorch cannot ``vmap`` the layer (e.g. LSTM in float64, an ``autograd.Function`` without ``setup_context``),
a loop over the samples of this one layer with plain autograd.
Shapes: B samples; ``out[name]`` is (N, B, *param.shape).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..batch import as_pytree


def per_sample_vjp(module: nn.Module, inputs: tuple[tuple, dict], in_dims: tuple[int | None, ...],
                   grad_outputs: list[torch.Tensor], out_dims: tuple[int | None, ...],
                   out: dict[str, torch.Tensor]) -> None:
    """Write the per-sample gradients of ``module``'s parameters named in ``out`` (dotted names inside it).

    Args:
        module: the layer; called as ``module(*args, **kwargs)`` with ``(args, kwargs) = inputs``.
        inputs: the call's arguments, detached (tensors with their batch dimension, in_dims).
        in_dims: per tensor leaf of ``inputs``: the dimension holding the B samples, or None (shared).
        grad_outputs: per tensor leaf of the layer's output: (N, *leaf.shape) (zeros where unused).
        out_dims: per tensor leaf of the output: its batch dimension (never None here).
        out: {dotted parameter name: (N, B, *param.shape)}, overwritten.
    """
    leaves, spec = tree_flatten(inputs)
    slots = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    tensors = [leaves[k] for k in slots]
    params = {name: module.get_parameter(name).detach() for name in out}
    differentiable = [k for k, g in enumerate(grad_outputs) if g is not None]
    cotangents = [grad_outputs[k] for k in differentiable]
    cot_dims = [out_dims[k] + 1 for k in differentiable]  # a leading N in front of each output

    def layer(p: dict[str, torch.Tensor], xs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        args = list(leaves)
        for k, x in zip(slots, xs, strict=True):
            args[k] = x
        a, kw = tree_unflatten(args, spec)
        outputs = [t for t in tree_flatten(as_pytree(functional_call(module, p, tuple(a), kw)))[0]
                   if isinstance(t, torch.Tensor)]
        return tuple(outputs[k] for k in differentiable)

    def one_sample(xs: list[torch.Tensor], cots: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        xs = [x if d is None else x.unsqueeze(d) for x, d in zip(xs, in_dims, strict=True)]
        cots = [c.unsqueeze(d) for c, d in zip(cots, cot_dims, strict=True)]
        _, pullback = vjp(lambda p: layer(p, xs), params)
        return vmap(pullback)(tuple(cots))[0]  # over the N rows: {name: (N, *shape)}

    try:
        result = vmap(one_sample, in_dims=(list(in_dims), cot_dims), out_dims=1)(tensors, cotangents)
    except (RuntimeError, NotImplementedError, ValueError):
        # vmap has no batching rule for something inside the layer: one sample (and one row) at a time.
        _loop(layer, params, tensors, in_dims, cotangents, cot_dims, out)
        return
    for name, t in out.items():
        t.copy_(result[name])


def _loop(layer, params, tensors, in_dims, cotangents, cot_dims, out) -> None:
    """One sample (and one row) at a time with plain autograd: also what ``torch.func`` cannot run at all (an
    ``autograd.Function`` written without ``setup_context``)."""
    n = next(iter(out.values())).shape[0]
    batch = next(iter(out.values())).shape[1]
    with torch.enable_grad():
        for b in range(batch):
            xs = [x if d is None else x.narrow(d, b, 1) for x, d in zip(tensors, in_dims, strict=True)]
            leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
            outputs = layer(leaves, xs)
            for row in range(n):
                cots = tuple(c.narrow(d, b, 1)[row] for c, d in zip(cotangents, cot_dims, strict=True))
                grads = torch.autograd.grad(outputs, list(leaves.values()), cots, retain_graph=row < n - 1,
                                            allow_unused=True)
                for t, g in zip(out.values(), grads, strict=True):
                    if g is None:
                        t[row, b].zero_()
                    else:
                        t[row, b].copy_(g)
