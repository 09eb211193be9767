"""Per-sample losses from one batched forward pass.

"The loss of sample i" is ``loss_fn(output[i:i+1], targets[i:i+1])``: exactly what the naive loop
computes, whatever ``loss_fn``'s reduction. For the common ``torch.nn`` losses this is computed with
``reduction='none'`` and a per-sample sum or mean; any other callable goes through ``torch.func.vmap``
(or, if it cannot be vmapped, a loop over samples on the already computed outputs).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Losses whose reduction='none' output is one term per element, so that 'sum' / 'mean' over the
# elements of one sample equals the loss of that sample alone.
_ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
                nn.SoftMarginLoss)
_CLASS_INDEX = (nn.CrossEntropyLoss, nn.NLLLoss)


def _fast_path_ok(loss_fn: LossFn, targets: torch.Tensor) -> bool:
    reduction = getattr(loss_fn, "reduction", None)
    # Exact types only: a subclass may override forward with its own reduction.
    if reduction not in ("sum", "mean"):
        return False
    if type(loss_fn) in _ELEMENTWISE:
        return True
    if type(loss_fn) in _CLASS_INDEX:
        if reduction == "sum":
            return True
        # 'mean' is a weighted mean, and 0/0 for a sample whose targets are all ignored.
        has_ignored = targets.dtype == torch.long and bool((targets == loss_fn.ignore_index).any())
        return loss_fn.weight is None and not has_ignored
    return False


def per_sample_losses(loss_fn: LossFn, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Loss of each sample, shape (B,), differentiable with respect to ``output``.

    ``output`` is (B, *out) from one batched forward, ``targets`` is (B, ...).
    Element i equals ``loss_fn(output[i:i+1], targets[i:i+1])``.
    """
    if _fast_path_ok(loss_fn, targets):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        terms = unreduced(output, targets)
        terms = terms.reshape(terms.shape[0], -1)
        return terms.sum(1) if loss_fn.reduction == "sum" else terms.mean(1)
    try:
        return torch.func.vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(output, targets)
    except Exception:  # loss functions that vmap cannot batch (data-dependent control flow, .item(), ...)
        return torch.stack([loss_fn(output[i:i + 1], targets[i:i + 1]) for i in range(output.shape[0])])


def summed_per_sample_loss(loss_fn: LossFn, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``per_sample_losses(loss_fn, output, targets).sum()``, a scalar, in one call of ``loss_fn`` where
    the reduction allows: 'sum' is already that sum, and 'mean' over equally sized samples is it / B."""
    if _fast_path_ok(loss_fn, targets):
        total = loss_fn(output, targets)
        return total * output.shape[0] if loss_fn.reduction == "mean" else total
    return per_sample_losses(loss_fn, output, targets).sum()
