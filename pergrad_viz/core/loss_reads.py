"""A loss that reads a trainable parameter itself, not only through the model's output (a weight penalty inside
``loss_fn``: ``cross_entropy(out, y) + lam * model.fc.weight.square().sum()``): each sample's gradient then holds
that term's gradient too, as the loop computes it.

Two consequences, handled here: strategies that take gradients at the layers' outputs (``hooks``) never see that
term, so they find it in the loss's own graph and hand over (:func:`parameters_read_by_loss`); ``torch.func``'s
``functional_call`` replaces the model's parameters for the model's forward only, so the loss is run inside the
same call (:func:`functional_loss`), where it reads the replaced ones.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pergrad_viz.core.batch import as_pytree
from pergrad_viz.core.functional import functional_call_once
from pergrad_viz.core.graph import walk
from pergrad_viz.core.losses import LossFn, sequence_loss, summed_per_sample_loss
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.errors import HandOverError


def parameters_read_by_loss(total: torch.Tensor, output: object, params: Sequence[torch.Tensor]) -> list[int]:
    """The positions in ``params`` that the scalar ``total`` (the loss of ``output``) reaches in its backward graph
    without going through ``output``'s tensors: the loss's own nodes only are walked (the model's graph lies below
    the output and is not entered), each once."""
    root = total.grad_fn
    if root is None:
        return []
    stops = [t.grad_fn for t in tree_flatten(as_pytree(output))[0] if isinstance(t, torch.Tensor)]
    wanted = {id(p): k for k, p in enumerate(params)}  # the parameters themselves are held by the caller
    found = set()
    for node in walk([root], stops):
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if variable is not None and id(variable) in wanted:
            found.add(wanted[id(variable)])
    return sorted(found)


def loss_reads_parameters(loss_fn, total: torch.Tensor, output: object, params: Sequence[torch.Tensor]) -> list[int]:
    """:func:`parameters_read_by_loss` of ``total = loss_fn(output, ...)``, none where ``loss_fn`` is known to read
    only its input (:func:`reads_only_its_input`: the walk is skipped)."""
    return [] if reads_only_its_input(loss_fn) else parameters_read_by_loss(total, output, params)


def reads_only_its_input(loss_fn) -> bool:
    """Whether ``loss_fn`` is known to read nothing trainable but its input: one of ``torch.nn``'s own losses (not a
    subclass) holding no tensor that requires grad (its class weights), or the package's sequence losses. The graph
    walk of :func:`parameters_read_by_loss` (10-100 us on a call's first touch of the graph's nodes) is skipped."""
    if type(loss_fn).__module__ == "torch.nn.modules.loss":
        return not any(t.requires_grad for t in (*loss_fn.parameters(), *loss_fn.buffers()))
    return sequence_loss(loss_fn) is not None


class _ModelAndLoss(nn.Module):
    """The model and the loss of its output as one module, for ``functional_call``."""

    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        object.__setattr__(self, "loss_fn", loss_fn)  # not a submodule: a loss module's tensors are left as they are

    def forward(self, args: tuple, kwargs: dict, targets: object) -> object:
        return self.loss_fn(self.model(*args, **kwargs), targets)


def functional_loss(model: nn.Module, values: Mapping[str, torch.Tensor], args: tuple, kwargs: dict, loss_fn,
                    targets: object) -> object:
    """``loss_fn(model(*args, **kwargs), targets)`` with the model's tensors named in ``values`` replaced by them
    (``torch.func.functional_call``) for the model's forward *and* the loss: a loss that reads a parameter reads
    the replaced one, whose gradient then counts."""
    return functional_call_once(_ModelAndLoss(model, loss_fn), {f"model.{n}": t for n, t in values.items()},
                                (args, kwargs, targets))


def loss_of_output(trainable: Trainable, loss_fn: LossFn, output: object, targets: object) -> torch.Tensor:
    """The summed per-sample losses of the captured forward's ``output``; :class:`HandOverError` where the loss
    reads a trainable parameter itself (a weight penalty inside ``loss_fn``), whose part of each sample's gradient
    gradients at the layers' outputs would miss."""
    total = summed_per_sample_loss(loss_fn, output, targets)
    read = loss_reads_parameters(loss_fn, total, output, trainable.params)
    if read:
        names = ", ".join(repr(trainable.names[k]) for k in read[:3]) + (", ..." if len(read) > 3 else "")
        raise HandOverError(
            f"loss_fn reads the trainable parameter(s) {names} itself, not only through the model's output (a weight "
            "penalty inside the loss?): the hooks strategy takes each sample's gradient at the layers' outputs and "
            "would miss that part of it. Use strategy='auto' or 'torch_func' (which run the loss with the "
            "parameters) or 'loop'; or leave the penalty out of loss_fn and add its gradient, the same for every "
            "sample, yourself",
            reason="the loss reads a trainable parameter itself")
    return total
