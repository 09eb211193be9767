"""One module per strategy, each with the same two functions.

``grads(trainable, loss_fn, inputs, targets, out)`` writes the per-sample gradients of a batch (B, ...)
into ``out[name]`` of shape (B, *param.shape); ``jacobian(trainable, inputs, out)`` writes the per-sample
output Jacobians into ``out[name]`` of shape (B, Y, *param.shape). ``out`` holds every trainable
parameter's name; the caller (``pergrad_viz.api``) validates, allocates, chunks and guards the model.
"""

from __future__ import annotations

from types import ModuleType

from pergrad_viz.strategies import autograd_stack, batched_grad, hooks, loop, torch_func

STRATEGIES: tuple[str, ...] = ("loop", "autograd_stack", "torch_func", "batched_grad", "hooks")

MODULES: dict[str, ModuleType] = {
    "loop": loop,
    "autograd_stack": autograd_stack,
    "torch_func": torch_func,
    "batched_grad": batched_grad,
    "hooks": hooks,
}
