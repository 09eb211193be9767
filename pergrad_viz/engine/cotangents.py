"""Whether ``vmap`` over the samples of a backward batched over output vectors (``vmap(jacrev)``: ``torch_func``'s
Jacobian, and the per-layer fallback's inside ``hooks``' Jacobian) gives this model's numbers. A batching rule can be
wrong where both are batched: PyTorch 2.14's of ``torch.cdist``'s backward gives other Jacobians for two samples
vmapped together than for each alone (each level alone is right: ``vmap(grad)``, ``jacrev`` of one sample), and
with ``verify=False`` nothing else would catch it. Measured once per plan key and ``output=``: the strategy's own
Jacobian of samples 0 and 1 together against each alone (three small runs); where they differ, the strategy hands
over (``auto``: the next one; the loop is the definition)."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import torch
from torch import nn

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.float64 import float64_copy, to_float64
from pergrad_viz.core.tolerances import tolerance
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.plan import LayerKind
from pergrad_viz.engine.plan_key import call_key
from pergrad_viz.engine.probe import plan_for
from pergrad_viz.errors import HandOverError

JacobianFn = Callable[[Trainable, Batch, dict[str, torch.Tensor]], None]  # writes (B, Y, *shape) into out

_FOUND: weakref.WeakKeyDictionary[nn.Module, dict[tuple, str | None]] = weakref.WeakKeyDictionary()


def has_fallback_layers(trainable: Trainable, inputs: Batch) -> bool:
    """Whether some layer of the plan takes the per-layer fallback (``torch.func`` on that layer: its Jacobian is a
    ``vmap`` over the samples of a ``vjp`` batched over output vectors)."""
    return any(lp.kind is LayerKind.FALLBACK for lp in plan_for(trainable, inputs).layers.values())


def refuse_wrong_nesting(trainable: Trainable, inputs: Batch, strategy: str, jacobian: JacobianFn,
                         out: dict[str, torch.Tensor]) -> None:
    """HandOverError where ``jacobian`` (``strategy``'s, unguarded) gives samples 0 and 1 together other Jacobians
    than each alone; ``out``: the call's result {name: (B, Y, *shape)}, whose shapes the trial takes."""
    if inputs.size < 2:
        return
    key = (call_key(trainable, inputs), strategy)  # the key holds output='s selection
    found = _FOUND.setdefault(trainable.model, {})
    if key not in found:
        if len(found) >= 16:  # input signatures and output= selections change: kept small
            found.clear()
        found[key] = _measured(trainable, inputs, jacobian, out)
    why = found[key]
    if why is not None:
        raise HandOverError(f"{why}: the {strategy} strategy cannot give this model's Jacobian. Use strategy='auto' "
                            "or 'loop'", reason=why)


def _measured(trainable: Trainable, inputs: Batch, jacobian: JacobianFn, out: dict[str, torch.Tensor]) -> str | None:
    """Why ``jacobian`` gives two samples together other Jacobians than each alone, else None; below float64 a
    difference is settled on a float64 copy (a Jacobian that is exactly 0, a bias before a GroupNorm, is float32
    noise unlike alone and together; PyTorch's wrong batching rule is wrong in float64 too)."""
    why = _trial(trainable, inputs, jacobian, out)
    if why is None or trainable.dtype == torch.float64 or (copied := float64_copy(trainable)) is None:
        return why
    try:
        return _trial(copied, inputs.map(to_float64), jacobian, {n: t.double() for n, t in out.items()})
    except (RuntimeError, TypeError, ValueError):  # the model does not run in float64: the float32 finding stands
        return why


def _trial(trainable: Trainable, inputs: Batch, jacobian: JacobianFn, out: dict[str, torch.Tensor]) -> str | None:
    def empty(n: int) -> dict[str, torch.Tensor]:
        return {name: torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=t.device) for name, t in out.items()}

    together = empty(2)
    jacobian(trainable, inputs.rows(slice(0, 2)), together)
    for i in range(2):
        alone = empty(1)
        jacobian(trainable, inputs.rows(slice(i, i + 1)), alone)
        # rounding of its layer's Jacobian's size is no difference: a conv's bias before a GroupNorm, exactly 0,
        # is float32 noise of 1e-8 of the conv's, twice unlike (a wrong batching rule is off by the layer's own size:
        # the layer's, not the whole model's, which a large branch elsewhere would make a cover for it)
        layers: dict[str, float] = {}  # each layer's norm (a hypot: float64's 1e155 squared raised in Python)
        for name, t in alone.items():
            owner = name.rpartition(".")[0]
            layers[owner] = math.hypot(layers.get(owner, 0.0), float(torch.linalg.vector_norm(
                t[0][torch.isfinite(t[0])].double())))
        for name, t in alone.items():
            want, got = t[0], together[name][i]
            rtol = tolerance(want.dtype, want.device).check
            layer = layers[name.rpartition(".")[0]]
            if not _close(got, want, rtol, ROUNDING * torch.finfo(want.dtype).eps * layer):
                return (f"vmap over the samples of a backward batched over output vectors gives two samples other "
                        f"Jacobians than each alone here (parameter {name!r}: a wrong batching rule in PyTorch, such "
                        "as torch.cdist's backward's)")
    return None


ROUNDING = 1000  # a difference under this many eps of its layer's Jacobian's norm is rounding


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, least: float = 0.0) -> bool:
    finite = torch.isfinite(want)
    if not torch.equal(finite, torch.isfinite(got)):
        return False
    got, want = got[finite].double(), want[finite].double()
    diff = float(torch.linalg.vector_norm(got - want))
    return diff <= least or diff <= rtol * max(float(torch.linalg.vector_norm(want)), 1e-300)
