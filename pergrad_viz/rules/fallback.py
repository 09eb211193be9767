"""The per-layer fallback: per-sample gradients of one layer without a closed-form rule, from ``torch.func``.

For a layer call that saw inputs ``xs`` and whose outputs got the gradients ``gs`` (one row per sample along
each tensor's batch dimension), the per-sample gradient of sample b is the vector-Jacobian product of the
layer *alone*, run on sample b's inputs (a batch of one), with sample b's output gradients. That is
``vmap`` over the samples of ``vjp(functional_call(layer, params, sample))``, and ``vmap`` over the N
gradient rows (N = Y for Jacobians) of the vjp function. The rest of the model stays on its rules.

Where PyTorch cannot ``vmap`` the layer (e.g. LSTM in float64, an ``autograd.Function`` without ``setup_context``),
a loop over the samples of this one layer with plain autograd.

Faster where it is measured to be the same: a layer whose parameters enter its output only through broadcasting
elementwise operations (``x * w + b``, ``x + gate * tanh(fc(x))``) computes sample b's output from row b of a
per-sample copy of each parameter, ``P = p.expand(B, 1, ..., *p.shape)``; one batched backward of the layer, with
its output gradients, then gives every sample's gradient at once (autograd sums each row over the broadcast
dimensions), with no ``vmap`` or ``vjp`` around it. Whether a layer is such a layer is decided per layer and call
signature (shapes, dtypes, batch dimensions, training flag) by computing its first call with B >= 2 both ways:
only where the rows agree (a parameter that mixes samples, ``w.mean(0)`` on the copies, would not) do later calls
take the short path; everywhere else, the ``vmap`` path. Each call's result is still checked by the per-call check
(``pergrad_viz.engine.certify``).
Shapes: B samples; ``out[name]`` is (N, B, *param.shape).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.func import vjp, vmap
from torch.utils._pytree import tree_flatten, tree_unflatten

from pergrad_viz.core.batch import as_pytree
from pergrad_viz.core.functional import functional_call_once
from pergrad_viz.core.tolerances import tolerance
from pergrad_viz.errors import HandOverError


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
        outputs = [t for t in tree_flatten(as_pytree(functional_call_once(module, p, tuple(a), kw)))[0]
                   if isinstance(t, torch.Tensor)]
        return tuple(outputs[k] for k in differentiable)

    rows = cotangents[0].shape[0] if cotangents else 1

    def one_sample(xs: list[torch.Tensor], cots: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        xs = [x if d is None else x.unsqueeze(d) for x, d in zip(xs, in_dims, strict=True)]
        cots = [c.unsqueeze(d) for c, d in zip(cots, cot_dims, strict=True)]
        _, pullback = vjp(lambda p: layer(p, xs), params)
        if rows == 1:  # gradients: one row, no inner vmap
            return {n: g.unsqueeze(0) for n, g in pullback(tuple(c[0] for c in cots))[0].items()}
        return vmap(pullback)(tuple(cots))[0]  # over the N rows: {name: (N, *shape)}

    if all(d is None for d in in_dims):  # no input holds the samples, the output does (``code.repeat(B, 1)``)
        _masked(layer, params, tensors, cotangents, cot_dims, out)
        return
    key = _signature(module, tensors, in_dims, cotangents, out_dims, differentiable, out)
    verdicts = _ELEMENTWISE.setdefault(module, {})
    if key is not None and verdicts.get(key) and _expanded(layer, params, tensors, cotangents, out):
        return
    try:
        result = vmap(one_sample, in_dims=(list(in_dims), cot_dims), out_dims=1)(tensors, cotangents)
    except (RuntimeError, NotImplementedError, ValueError):
        # vmap has no batching rule for something inside the layer: one sample (and one row) at a time.
        _replayed(module, lambda: _loop(layer, params, tensors, in_dims, cotangents, cot_dims, out))
        return
    for name, t in out.items():
        t.copy_(result[name])
    if key is not None and key not in verdicts:
        verdicts[key] = _agrees(layer, params, tensors, cotangents, out)


def _replayed(module: nn.Module, replay) -> None:
    """``replay()``, the layer run again one sample at a time; where that fails although the batched forward ran
    (a call holding state of the whole batch, as a Hugging Face cache object among its arguments), the fallback
    cannot serve this layer: :class:`~pergrad_viz.errors.HandOverError` (``auto`` runs each sample of the whole model
    alone instead). Running out of memory is not such a failure: it is raised as it is."""
    try:
        replay()
    except (torch.OutOfMemoryError, MemoryError):
        raise
    except (RuntimeError, NotImplementedError, ValueError, TypeError, IndexError) as e:
        first = str(e).splitlines()[0][:160] if str(e) else ""
        raise HandOverError(
            f"the per-layer fallback cannot run {type(module).__name__} one sample at a time ({type(e).__name__}: "
            f"{first}), although the batched forward ran: its call may hold state of the whole batch (a cache "
            f"object among its arguments, or a tensor of the batch it keeps in an attribute{_kept(module)}). Use "
            "strategy='auto' or 'torch_func' (each sample of the whole model alone) or 'loop'; for a Hugging Face "
            "model with a cache, model_kwargs={'use_cache': False} may let this layer be replayed",
            reason=f"the per-layer fallback cannot replay {type(module).__name__}") from e


def _kept(module: nn.Module) -> str:
    """``": self.x (4, 32)"``: the tensors a layer keeps in plain attributes (RecurrentGemma's recurrent_states)."""
    kept = [f"self.{k} {tuple(v.shape)}" for k, v in vars(module).items() if isinstance(v, torch.Tensor) and v.dim()]
    return f": {', '.join(kept[:3])}" if kept else ""


# {layer: {call signature: whether its parameters enter only elementwise (the short path gives the vmap rows)}}
_ELEMENTWISE: weakref.WeakKeyDictionary[nn.Module, dict[tuple, bool]] = weakref.WeakKeyDictionary()


def _signature(module: nn.Module, tensors: list[torch.Tensor], in_dims: tuple[int | None, ...],
               cotangents: list[torch.Tensor], out_dims: tuple[int | None, ...], differentiable: list[int],
               out: dict[str, torch.Tensor]) -> tuple | None:
    """The key under which a layer's short-path verdict is kept; None where the short path does not apply: a
    batch dimension other than the first, or one sample (a single row cannot show samples mixing)."""
    batch = next(iter(out.values())).shape[1]
    if batch < 2 or any(d not in (0, None) for d in in_dims) or any(out_dims[k] != 0 for k in differentiable):
        return None
    return (module.training, tuple(out), tuple((tuple(t.shape), t.dtype, d) for t, d in zip(tensors, in_dims,
                                                                                             strict=True)),
            tuple(tuple(c.shape) for c in cotangents))


def _expanded(layer, params: dict[str, torch.Tensor], tensors: list[torch.Tensor],
              cotangents: list[torch.Tensor], out: dict[str, torch.Tensor]) -> bool:
    """The short path: per-sample parameter copies (B, 1, ..., *shape), one batched backward. Writes ``out``
    {name: (N, B, *shape)} and returns True, or returns False (``out`` untouched) where the layer does not take
    such copies (a shape error, outputs of other shapes)."""
    n, batch = next(iter(out.values())).shape[:2]
    rank = cotangents[0].dim() - 1  # of the layer's (first) output, without the N rows
    copies = {}
    for name, p in params.items():
        pad = rank - 1 - p.dim()
        if pad < 0:
            return False
        copies[name] = p.reshape(1, *[1] * pad, *p.shape).expand(batch, *[1] * pad, *p.shape).requires_grad_()
    try:
        with torch.enable_grad():
            outputs = layer(copies, tensors)
            if [tuple(o.shape) for o in outputs] != [tuple(c.shape[1:]) for c in cotangents]:
                return False
            if n == 1:
                grads = torch.autograd.grad(outputs, list(copies.values()), [c[0] for c in cotangents],
                                            allow_unused=True)
            elif torch.is_anomaly_enabled():  # no batching rule there: the attempt would fail, reported as an error
                return False
            else:
                grads = torch.autograd.grad(outputs, list(copies.values()), cotangents, is_grads_batched=True,
                                            allow_unused=True)
    except (RuntimeError, NotImplementedError, ValueError, TypeError, IndexError):
        return False
    for t, g in zip(out.values(), grads, strict=True):
        if g is None:
            t.zero_()
        else:
            t.copy_(g.reshape(t.shape))
    return True


def _agrees(layer, params: dict[str, torch.Tensor], tensors: list[torch.Tensor], cotangents: list[torch.Tensor],
            out: dict[str, torch.Tensor]) -> bool:
    """Whether the short path gives the rows ``out`` the ``vmap`` path just wrote (to rounding)."""
    trial = {name: torch.empty_like(t) for name, t in out.items()}
    if not _expanded(layer, params, tensors, cotangents, trial):
        return False
    first = next(iter(out.values()))
    tol = tolerance(first.dtype, first.device).replay
    # rows of a non-finite sample (a NaN input) are compared where they are finite, and must be non-finite alike
    return all(torch.allclose(trial[name], t, rtol=tol, atol=tol * _largest_finite(t), equal_nan=True)
               for name, t in out.items())


def _largest_finite(t: torch.Tensor) -> float:
    """The largest finite magnitude in ``t`` (0 where none is finite)."""
    finite = t.abs().nan_to_num(nan=0.0, posinf=0.0)
    return float(finite.max()) if finite.numel() else 0.0


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


def _masked(layer, params, tensors, cotangents, cot_dims, out) -> None:
    """A layer whose inputs hold no samples but whose outputs do (a positional code made from the image size and
    repeated B times: a replay of one sample would give all B rows): its call replayed once, whole; sample b's
    gradient the vector-Jacobian product of its own rows of the output gradients, every other sample's zero (sample
    b's loss reaches the layer's output through its rows alone)."""
    n, batch = next(iter(out.values())).shape[:2]
    _, pullback = vjp(lambda p: layer(p, tensors), params)  # its pullback may be called again and again
    cots = [torch.zeros_like(c) for c in cotangents]  # one buffer each: sample b's rows in, then out again
    for b in range(batch):
        for own, c, d in zip(cots, cotangents, cot_dims, strict=True):
            own.select(d, b).copy_(c.select(d, b))
        grads = vmap(pullback)(tuple(cots))[0] if n > 1 else pullback(tuple(c[0] for c in cots))[0]
        for name, t in out.items():
            t[:, b].copy_(grads[name].reshape(t[:, b].shape))
        for own, d in zip(cots, cot_dims, strict=True):
            own.select(d, b).zero_()
