"""The strategies as data: one :class:`Strategy` record per way of computing per-sample results, in
:data:`REGISTRY` by name.

Every strategy has the same two functions. ``grads(trainable, loss_fn, inputs, targets, out)`` writes the
per-sample gradients of a batch (B, ...) into ``out[name]`` of shape (B, *param.shape); ``jacobian(trainable,
inputs, out)`` writes the per-sample output Jacobians into ``out[name]`` of shape (B, Y, *param.shape). ``out``
holds every trainable parameter's name; the caller (``pergrad_viz.api``) validates, allocates, chunks and guards
the model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pergrad_viz.core.guards import refusing_reentrant_checkpoints
from pergrad_viz.strategies import autograd_stack, batched_grad, hooks, loop, torch_func

# (trainable, loss_fn, inputs, targets, out) -> None; (trainable, inputs, out) -> None
GradsFn = Callable[..., None]
JacobianFn = Callable[..., None]
# (chunk, num_params, largest_param, itemsize, outputs) -> bytes
WorkingBytesFn = Callable[[int, int, int, int, int], int]


@dataclass(frozen=True)
class Strategy:
    """One strategy: what it computes with, what it needs, and how the benchmarks treat it.

    ``working_bytes(chunk, num_params, largest_param, itemsize, outputs)`` is the extra memory it needs beyond the
    result for one chunk of ``chunk`` samples (``outputs`` = Y for Jacobians, 1 for gradients).
    ``batched_forward``: it runs the model once on the whole batch, so it is refused where the samples interact
    and its results go through the per-call check (``pergrad_viz.engine.certify``). ``slow_baseline``: a
    baseline of B (x Y) backward passes, skipped by the benchmarks above their size limit.
    """

    name: str
    grads: GradsFn
    jacobian: JacobianFn
    working_bytes: WorkingBytesFn
    batched_forward: bool
    slow_baseline: bool
    summary: str = ""


def _guarded(fn: Callable[..., None]) -> Callable[..., None]:
    """``fn`` with PyTorch's refusal of a reentrant checkpoint turned into one clear error, the same in every
    strategy (:func:`pergrad_viz.core.validate.refusing_reentrant_checkpoints`)."""

    @functools.wraps(fn)
    def run(*args: object, **kwargs: object) -> None:
        with refusing_reentrant_checkpoints():
            return fn(*args, **kwargs)

    return run


REGISTRY: dict[str, Strategy] = {s.name: dataclasses.replace(s, grads=_guarded(s.grads), jacobian=_guarded(s.jacobian))
                                 for s in (
    Strategy("loop", loop.grads, loop.jacobian, loop.working_bytes, batched_forward=False, slow_baseline=True,
             summary="a Python loop over samples (and outputs): the definition every other strategy is checked "
                     "against"),
    Strategy("autograd_stack", autograd_stack.grads, autograd_stack.jacobian, autograd_stack.working_bytes,
             batched_forward=True, slow_baseline=True,
             summary="one batched forward, one torch.autograd.grad per per-sample loss (or output element)"),
    Strategy("torch_func", torch_func.grads, torch_func.jacobian, torch_func.working_bytes, batched_forward=False,
             slow_baseline=False, summary="torch.func: vmap of grad / jacrev, each sample alone"),
    Strategy("batched_grad", batched_grad.grads, batched_grad.jacobian, batched_grad.working_bytes,
             batched_forward=True, slow_baseline=True,
             summary="torch.autograd.grad(is_grads_batched=True) with one-hot grad outputs"),
    Strategy("hooks", hooks.grads, hooks.jacobian, hooks.working_bytes, batched_forward=True, slow_baseline=False,
             summary="one hooked forward, one backward to the layer outputs, closed-form layer rules"),
)}

STRATEGIES: tuple[str, ...] = tuple(REGISTRY)


def working_bytes(strategy: str, chunk: int, batch: int, num_params: int, dtype: torch.dtype,
                  outputs: int = 1, largest_param: int | None = None) -> int:
    """Extra memory ``strategy`` needs beyond the result, for one chunk of ``chunk`` samples (its record's
    estimate; ``largest_param`` defaults to ``num_params``)."""
    largest = num_params if largest_param is None else largest_param
    return REGISTRY[strategy].working_bytes(chunk, num_params, largest, dtype.itemsize, outputs)
