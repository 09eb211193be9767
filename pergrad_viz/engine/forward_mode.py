"""Each sample alone by forward mode: ``vmap`` over the samples of a ``jvp`` along a direction, the per-call
check's reference for every row at once without a loop (forward-mode formulas are independent of the backward ones a
strategy batches), the direction's scale per parameter and where it must be 0, and the screen's way of running it
(never the user's error, nor warning; a model forward mode cannot run is remembered)."""

from __future__ import annotations

import torch
from torch import nn
from torch.func import jvp, vmap
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.core.functional import functional_call_once
from pergrad_viz.core.loss_reads import functional_loss
from pergrad_viz.core.losses import LossFn, scalar_loss
from pergrad_viz.core.process import quiet
from pergrad_viz.core.trainable import Trainable


def direction_scale(mean_squares: torch.Tensor) -> torch.Tensor:
    """(K,): 1 / each parameter tensor's typical row norm, from the rows' mean squared norms (K,); 0 where every row
    is 0 (an unused parameter, a zero-initialised gain: its part of the direction would only overflow)."""
    typical = mean_squares.sqrt()
    return torch.where(typical > 0, 1 / typical.clamp_min(torch.finfo(typical.dtype).tiny), 0.0)


def screened_jvp(trainable: Trainable, loss_fn: LossFn | None, inputs: Batch, targets: object,
                 tangents: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """:func:`jvp_each` for a screen: None where forward mode cannot run the model (no formula, as for the CPU's
    flash attention; data-dependent control flow under vmap), remembered in the plan for this loss (by its name) and
    batch size so that its later checked calls do not try again (not where the failure may pass: a warning the
    user's filters make an error, memory); nothing it raises or warns reaches the caller."""
    what = None if loss_fn is None else getattr(loss_fn, "__qualname__", type(loss_fn).__qualname__)
    plan, key = trainable.call.plan, (what, inputs.size)
    if plan is not None and key in plan.no_forward_mode:
        return None
    try:
        with quiet():  # vmap's notes on its slow paths: not the user's
            if loss_fn is None:
                return jvp_each(trainable, None, inputs, targets, tangents)
            return _loss_along(trainable, loss_fn, inputs, targets, tangents)
    except Exception as e:
        if plan is not None and not isinstance(e, Warning | torch.OutOfMemoryError):
            plan.no_forward_mode.add(key)
        return None


def _loss_along(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
                tangents: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B,): :func:`jvp_each` of the loss by the chain rule, ``dL_i/do_i . (J_i v)``: forward mode through the model
    alone (each sample's outputs o_i and their tangents), then each sample's loss of its own outputs by reverse mode
    (no forward-mode formula of the loss: cross-entropy's would import sympy, some 0.3 s on a first call). A loss
    that reads a parameter itself leaves that part out (the screen then suspects a row, which the sample alone
    clears; book-keeping hands such a loss over anyway)."""
    params = {n: p.detach() for n, p in zip(trainable.names, trainable.params, strict=True)}
    frozen = trainable.frozen_state()

    def one(xs: list[torch.Tensor]) -> tuple:
        sample = inputs.with_leaves([x.unsqueeze(0) for x in xs])
        return jvp(lambda p: functional_call_once(trainable.model, {**p, **frozen}, sample.args, sample.kwargs),
                   (params,), (tangents,))

    with quiet(r"torch\.jit\.script.*deprecated"):
        outputs, moved = vmap(one)(inputs.leaves())
    (leaves, spec), moves = tree_flatten(outputs), tree_flatten(moved)[0]
    along = []
    for i in range(inputs.size):  # the loss of sample i's own outputs (B small losses, no model)
        own = [t[i].detach().requires_grad_() if t.is_floating_point() else t[i] for t in leaves]
        loss = scalar_loss(loss_fn(tree_unflatten(own, spec),
                                   None if targets is None else cut(targets, slice(i, i + 1), inputs.size)))
        floats = [k for k, t in enumerate(own) if t.requires_grad]
        grads = torch.autograd.grad(loss, [own[k] for k in floats], allow_unused=True)
        along.append(sum((g * moves[k][i]).sum() for k, g in zip(floats, grads, strict=True) if g is not None))
    return torch.stack([torch.as_tensor(a, dtype=params[trainable.names[0]].dtype) for a in along])


def jvp_each(trainable: Trainable, loss_fn: LossFn | None, inputs: Batch, targets: object,
              tangents: dict[str, torch.Tensor]) -> torch.Tensor:
    """Per sample, alone: the derivative of its loss (of its outputs (Y,)) along ``tangents``; (B,) or (B, Y)."""
    params = {n: p.detach() for n, p in zip(trainable.names, trainable.params, strict=True)}
    frozen = trainable.frozen_state()
    select = trainable.select or (lambda o: o)

    def one(xs: list[torch.Tensor], y: object) -> torch.Tensor:
        sample = inputs.with_leaves([x.unsqueeze(0) for x in xs])

        def value(p: dict[str, torch.Tensor]) -> torch.Tensor:
            if loss_fn is None:
                output = functional_call_once(trainable.model, {**p, **frozen}, sample.args, sample.kwargs)
                return select(output).reshape(-1)
            return scalar_loss(functional_loss(trainable.model, {**p, **frozen}, sample.args, sample.kwargs, loss_fn,
                                               None if y is None else tree_map(lambda t: t.unsqueeze(0), y)))

        return jvp(value, (params,), (tangents,))[1]

    with quiet(r"torch\.jit\.script.*deprecated"):  # forward mode's first use loads PyTorch's jvp decompositions
        if loss_fn is None or targets is None:  # a Jacobian's outputs; a loss of the output alone (targets=None)
            return vmap(lambda xs: one(xs, None))(inputs.leaves())
        return vmap(one)(inputs.leaves(), targets)


def without_padding_rows(trainable: Trainable, tangents: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tangents`` with an Embedding's padding row 0: its backward leaves that row's gradient 0 while its forward
    reads the row (a weight tied to an output layer would move it), so the two modes would differ there."""
    names = {id(p): n for n, p in zip(trainable.names, trainable.params, strict=True)}
    for _, module in trainable.modules:
        if isinstance(module, nn.Embedding | nn.EmbeddingBag) and module.padding_idx is not None:
            name = names.get(id(module.weight))
            if name is not None:
                tangents[name][module.padding_idx] = 0
    return tangents
