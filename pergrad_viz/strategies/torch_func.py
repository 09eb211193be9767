"""``torch.func``: ``functional_call`` + ``vmap(grad)`` / ``vmap(jacrev)``.

The model is called as a pure function of its trainable parameters; frozen parameters and buffers are
passed along unchanged. Each sample is given to the model as a batch of one (``x.unsqueeze(0)``), so
the model and the loss see exactly what the loop gives them: samples cannot interact here.

Where ``torch.func`` cannot run the model (an operation without a batching rule, e.g. ``nn.GRU`` or ``nn.LSTM`` in
float64 in some PyTorch versions; data-dependent shapes such as an RNN on a ``PackedSequence``; an
``autograd.Function`` without ``setup_context``), :class:`VmapError` names the layer and the strategies that work.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn
from torch.func import grad, jacrev, vmap
from torch.utils._pytree import tree_map

from pergrad_viz.core.batch import Batch, batch_of_one, sample_dims
from pergrad_viz.core.functional import functional_call_once
from pergrad_viz.core.guards import check_takes_part
from pergrad_viz.core.loss_reads import functional_loss, reads_only_its_input
from pergrad_viz.core.losses import LossFn, scalar_loss
from pergrad_viz.core.process import NO_BATCHING_RULE, quiet
from pergrad_viz.core.randomness import random_state, set_random_state
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.cotangents import refuse_wrong_nesting
from pergrad_viz.engine.observe import tensors_of
from pergrad_viz.engine.plan_key import call_key
from pergrad_viz.errors import HandOverError, VmapError
from pergrad_viz.strategies.outputs import refuse_random_forward


def working_bytes(chunk: int, num_params: int, largest_param: int, itemsize: int, outputs: int = 1) -> int:
    """vmap builds a chunk's result in fresh tensors before it is copied into the caller's."""
    return chunk * outputs * num_params * itemsize


def _trainable(trainable: Trainable) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in zip(trainable.names, trainable.params, strict=True)}


def _vmapped(trainable: Trainable, batched: Callable[[], dict], one_sample: Callable[[dict], object]) -> dict:
    """``batched()`` (``vmap`` of ``grad`` or ``jacrev``); an error raised inside it becomes :class:`VmapError` naming
    the innermost layer that was running, if the same computation for one sample without any transform
    (``one_sample(state)``, a plain forward and loss on copies of the frozen parameters and buffers, so that nothing
    of the model changes) works: a limit of ``torch.func``, not an error of the model or the loss (where it fails too,
    its error there is raised, unchanged). Hooks to name the layer are only registered after a failure, for one more
    failing run: the call that works pays nothing. PyTorch's note that an operation runs without a batching rule
    (slower, not wrong: "please file us an issue") is not shown to the caller."""
    try:
        with quiet(NO_BATCHING_RULE):
            return batched()
    except (RuntimeError, NotImplementedError) as e:
        if isinstance(e, torch.OutOfMemoryError) or "can't allocate memory" in str(e):
            raise  # out of memory is not a limit of torch.func: the user's to see (chunk_size= bounds it)
        try:  # with grad on: a forward that differentiates inside itself (a force field) runs alone as in the loop
            one_sample({name: t.detach().clone() for name, t in trainable.frozen_state().items()})
        except Exception as own:
            # the model or the loss fails without torch.func too: their own error, as the sample alone raised it (under
            # vmap it may read otherwise: a label-shape check behind an .item() shows as vmap's data-dependence error)
            raise own from None
        raise VmapError(
            f"torch.func (vmap of grad / jacrev) failed {_failing_layer(trainable, batched)} "
            f"({str(e).splitlines()[0][:200]}), although one sample alone runs: torch.func cannot run something "
            "there (an operation without a batching rule, data-dependent shapes such as a PackedSequence, an "
            "autograd.Function without setup_context). Use strategy='auto' (which picks a strategy that works "
            "here) or 'loop'; 'hooks' where the model keeps the samples apart."
        ) from e


def _failing_layer(trainable: Trainable, batched: Callable[[], dict]) -> str:
    """Where ``batched()`` fails: "in layer 'name' (Type)", the innermost module running, or "in the backward pass"."""
    running: list[nn.Module] = []

    def enter(module: nn.Module, args: tuple) -> None:
        running.append(module)

    def leave(module: nn.Module, args: tuple, output: object) -> None:  # returns None: the output is kept
        if running:
            running.pop()

    handles = []
    for _, m in trainable.modules:
        handles.append(m.register_forward_pre_hook(enter))
        handles.append(m.register_forward_hook(leave))
    try:
        batched()
    except (RuntimeError, NotImplementedError):
        pass
    finally:
        for h in handles:
            h.remove()
    if not running:
        return "in the backward pass"
    names = {id(m): n for n, m in trainable.modules}
    return f"in layer '{names[id(running[-1])] or 'model'}' ({type(running[-1]).__name__})"


def _first(obj: object, dims: object = 0) -> object:
    """The first sample of ``obj`` as vmap hands it over (``dims`` as :func:`pergrad_viz.core.batch.batch_of_one`'s)."""
    if dims is None or isinstance(dims, int):
        return obj if dims is None else tree_map(lambda t: t[0] if isinstance(t, torch.Tensor) else t, obj)
    return tree_map(lambda t, d: t[0] if d == 0 else t, obj, dims)


def _call_one(trainable: Trainable, inputs: Batch, params: dict, state: dict, xs: list[torch.Tensor]) -> object:
    """The model on one sample: ``xs`` are that sample's batched tensors without their batch dimension."""
    one = inputs.with_leaves([x.unsqueeze(0) for x in xs])
    root, values = _functional_values(trainable, {**params, **state})
    return functional_call_once(root, values, one.args, one.kwargs)


def _functional_values(trainable: Trainable, values: dict) -> tuple[nn.Module, dict]:
    """(the module ``functional_call`` runs, ``values`` named as in it)."""
    root, prefix = _functional_root(trainable.model)
    return root, ({n.removeprefix(prefix): t for n, t in values.items()} if prefix else values)


def _functional_root(model: nn.Module) -> tuple[nn.Module, str]:
    """The module ``functional_call`` can run and the prefix its names lose: an ``nn.DataParallel`` without devices
    (on CPU) only calls its ``module``, which is run instead; one spread over devices is refused naming the fix."""
    prefix = ""
    while isinstance(model, nn.DataParallel):
        if model.device_ids:
            raise VmapError(
                "torch.func cannot run nn.DataParallel over devices (it replicates the module on every call). Pass "
                "model.module (the same parameters), or use strategy='auto' (which picks a strategy that works here) "
                "or 'loop'.")
        model, prefix = model.module, prefix + "module."
    return model, prefix


_REACHED: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, str | None]] = weakref.WeakKeyDictionary()


def _refuse_unreplaced(trainable: Trainable, inputs: Batch) -> None:
    """HandOverError where ``functional_call`` cannot replace a parameter the forward uses (a Python reference the
    module keeps, ``self._c = [self.weight]``): torch.func would give that parameter zeros. Found once per plan key on
    one sample: the parameters a plain forward's output reaches against those the replaced values reach."""
    key = call_key(trainable, inputs)
    found = _REACHED.get(trainable.model)
    if found is None or found[0] != key:
        found = _REACHED[trainable.model] = (key, _unreplaced(trainable, inputs.rows(slice(0, 1))))
    if found[1] is not None:
        raise HandOverError(f"parameter {found[1]!r} is reached through a reference torch.func's functional_call "
                            "cannot replace (a tensor the module keeps, e.g. self._c = [self.weight]): torch_func "
                            "would give it zeros. Use strategy='auto' or 'loop'",
                            reason=f"functional_call cannot replace parameter {found[1]!r}")


def _unreplaced(trainable: Trainable, one: Batch) -> str | None:
    def reached(output: object, tensors: list[torch.Tensor]) -> list[bool]:
        leaves = [t for t in tensors_of(output) if t.requires_grad and t.is_floating_point()]
        if not leaves:
            return [False] * len(tensors)
        total = sum(t.sum() for t in leaves)
        return [g is not None for g in torch.autograd.grad(total, tensors, allow_unused=True)]

    with torch.enable_grad():
        plain = reached(one(trainable.model), list(trainable.params))
        values = {n: p.detach().requires_grad_() for n, p in zip(trainable.names, trainable.params, strict=True)}
        root, named = _functional_values(trainable, {**values, **trainable.frozen_state()})
        replaced = reached(functional_call_once(root, named, one.args, one.kwargs), list(values.values()))
    return next((n for n, a, b in zip(trainable.names, plain, replaced, strict=True) if a and not b), None)


def _refuse_parameters_held_by_loss(trainable: Trainable, losses: torch.Tensor,
                                    loss_of_one: Callable[[dict], torch.Tensor]) -> None:
    """HandOverError where the loss read a trainable parameter through the Parameter object it holds (a penalty on
    ``W = model.fc.weight`` taken outside the loss): functional_call replaces the module's attribute, not that
    object, so torch.func would leave the penalty's gradient out of every row (a probe). Read from the batched pass
    itself: its per-sample ``losses`` (B,), formed with gradients recorded outside the transforms, require grad only
    where something outside them (such an object, inputs that require grad) reached the loss, so the usual call pays
    nothing. Only then is it looked into on one sample (``loss_of_one(values)``: the loss of replaced values reaches
    an original parameter), the random state put back; every call, as a loss may start reading one at any call."""
    if not losses.requires_grad:
        return
    drawn = random_state(trainable.device)
    try:
        with torch.enable_grad():
            values = {n: p.detach().requires_grad_() for n, p in zip(trainable.names, trainable.params, strict=True)}
            loss = loss_of_one(values)
            reached = torch.autograd.grad(loss, list(trainable.params), allow_unused=True) \
                if loss.requires_grad else [None] * len(trainable.params)
    finally:
        set_random_state(trainable.device, drawn)
    held = next((n for n, g in zip(trainable.names, reached, strict=True) if g is not None), None)
    if held is not None:
        raise HandOverError(f"loss_fn reads parameter {held!r} through the Parameter object it holds (a penalty on "
                            "a parameter taken outside the loss?): torch.func replaces the model's parameters, not "
                            "that object, and would leave its part out of every sample's gradient. Use "
                            "strategy='auto' or 'loop', or read it from the model inside loss_fn (model.fc.weight)",
                            reason=f"loss_fn holds parameter {held!r} itself")


def grads(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
          out: dict[str, torch.Tensor]) -> None:
    """Writes (B, *param.shape) into ``out`` with ``vmap(grad(loss of one sample))``."""
    refuse_random_forward(trainable, inputs)
    _refuse_unreplaced(trainable, inputs)
    frozen = trainable.frozen_state()

    def loss_of_one(params: dict[str, torch.Tensor], xs: list[torch.Tensor], y: object, state: dict = frozen
                    ) -> torch.Tensor:
        one = inputs.with_leaves([x.unsqueeze(0) for x in xs])
        root, values = _functional_values(trainable, {**params, **state})
        # the loss inside the functional call too: one that reads a parameter (a weight penalty) reads the replaced
        return scalar_loss(functional_loss(root, values, one.args, one.kwargs, loss_fn, batch_of_one(y, by_sample)))

    def checked(params: dict[str, torch.Tensor], xs: list[torch.Tensor], y: object) -> tuple:
        loss = loss_of_one(params, xs, y)
        check_takes_part(trainable, loss)  # under grad, requires_grad says whether the loss depends on params
        return loss, loss

    params = _trainable(trainable)
    leaves = inputs.leaves()
    # per target leaf: 0 where it holds the samples, None where it is shared (a number, a class-weight tensor)
    by_sample = sample_dims(targets, inputs.size)
    with torch.enable_grad():  # the losses then say whether anything outside the transforms reached them
        result, losses = _vmapped(
            trainable, lambda: vmap(grad(checked, has_aux=True), in_dims=(None, 0, by_sample))(params, leaves, targets),
            lambda state: loss_of_one(params, _first(leaves), _first(targets, by_sample), state))
    if not reads_only_its_input(loss_fn):
        _refuse_parameters_held_by_loss(trainable, losses, lambda values: loss_of_one(
            values, _first(leaves), _first(targets, by_sample)))
    with torch.no_grad():  # numbers only (inputs that require grad leave the result on a graph)
        for name in trainable.names:
            out[name].copy_(result[name])


def jacobian(trainable: Trainable, inputs: Batch, out: dict[str, torch.Tensor]) -> None:
    """Writes (B, Y, *param.shape) into ``out`` with ``vmap(jacrev(outputs of one sample))``."""
    refuse_random_forward(trainable, inputs)
    _refuse_unreplaced(trainable, inputs)
    refuse_wrong_nesting(trainable, inputs, "torch_func", _jacobian, out)
    _jacobian(trainable, inputs, out)


def _jacobian(trainable: Trainable, inputs: Batch, out: dict[str, torch.Tensor]) -> None:
    frozen = trainable.frozen_state()
    select = trainable.select or (lambda o: o)

    def outputs_of_one(params: dict[str, torch.Tensor], xs: list[torch.Tensor], state: dict = frozen
                       ) -> torch.Tensor:
        return select(_call_one(trainable, inputs, params, state, xs)).reshape(-1)

    def checked(params: dict[str, torch.Tensor], xs: list[torch.Tensor]) -> torch.Tensor:
        output = outputs_of_one(params, xs)
        check_takes_part(trainable, output, "model output")
        return output

    params = _trainable(trainable)
    leaves = inputs.leaves()
    result = _vmapped(trainable, lambda: vmap(jacrev(checked), in_dims=(None, 0))(params, leaves),
                      lambda state: outputs_of_one(params, _first(leaves), state))
    with torch.no_grad():  # numbers only (inputs that require grad leave the result on a graph)
        for name in trainable.names:
            out[name].copy_(result[name])
