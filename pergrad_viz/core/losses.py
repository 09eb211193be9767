"""Per-sample losses from one batched forward pass.

"The loss of sample i" is ``loss_fn(output[i:i+1], targets[i:i+1])``: exactly what the naive loop
computes, whatever ``loss_fn``'s reduction. For the common ``torch.nn`` losses this is computed with
``reduction='none'`` and a per-sample sum or mean; any other callable goes through ``torch.func.vmap``
(or, if it cannot be vmapped, a loop over samples on the already computed outputs).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from pergrad_viz.core.batch import as_pytree, batch_of_one, cut, from_pytree, sample_dims

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

# Losses whose reduction='none' output is one term per element, so that 'sum' / 'mean' over the
# elements of one sample equals the loss of that sample alone.
_ELEMENTWISE = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss,
                nn.SoftMarginLoss)
_CLASS_INDEX = (nn.CrossEntropyLoss, nn.NLLLoss)


def _class_targets_fit(loss_fn: object, output: torch.Tensor, targets: torch.Tensor) -> bool:
    """Class-index targets (B, d1, ...) for logits (B, C, d1, ...), or (CrossEntropyLoss) class probabilities
    of the logits' shape: no broadcasting anywhere."""
    if output.dim() < 2:
        return False
    if targets.is_floating_point():
        return type(loss_fn) is nn.CrossEntropyLoss and targets.shape == output.shape
    return tuple(targets.shape) == (output.shape[0], *output.shape[2:])


def _weights_fit(loss_fn: object, output: torch.Tensor) -> bool:
    """Element weights that broadcast over one sample's elements only (never across samples)."""
    for attr in ("weight", "pos_weight"):
        w = getattr(loss_fn, attr, None)
        if isinstance(w, torch.Tensor) and w.dim() >= output.dim():
            return False
    return True


def _fast_path_ok(loss_fn: LossFn, output: torch.Tensor, targets: torch.Tensor) -> bool:
    """Whether one batched call with reduction='none' is provably the per-sample losses for this call: an
    exact ``torch.nn`` loss type (a subclass may override forward), shapes that need no broadcasting."""
    reduction = getattr(loss_fn, "reduction", None)
    if not (isinstance(output, torch.Tensor) and isinstance(targets, torch.Tensor)) or reduction not in ("sum", "mean"):
        return False
    if output.dim() == 0 or output.shape[0] != targets.shape[0]:
        return False
    if type(loss_fn) in _ELEMENTWISE:
        return output.shape == targets.shape and _weights_fit(loss_fn, output)
    if type(loss_fn) in _CLASS_INDEX:
        if not _class_targets_fit(loss_fn, output, targets):
            return False
        if reduction == "sum":
            return True
        # 'mean' is a weighted mean, and 0/0 for a sample whose targets are all ignored.
        ignored = not targets.is_floating_point() and bool((targets == loss_fn.ignore_index).any())
        return loss_fn.weight is None and not ignored
    return False


def _not_scalar(shape: tuple) -> ValueError:
    return ValueError(
        f"loss_fn returned a tensor of shape {tuple(shape)} for one sample instead of a scalar: a per-sample "
        "gradient needs loss_fn(output, targets) to return one number (reduce it, e.g. .sum() or reduction='sum')"
    )


def scalar_loss(loss: torch.Tensor) -> torch.Tensor:
    """One sample's loss as a 0-dim tensor (a (1,)-shaped one is accepted); anything larger is refused."""
    if not isinstance(loss, torch.Tensor):
        raise _not_a_tensor(loss)
    _refuse_complex(loss)
    if loss.numel() != 1:
        raise _not_scalar(tuple(loss.shape))
    return loss.reshape(())


def _refuse_complex(loss: torch.Tensor) -> None:
    if loss.is_complex():
        raise TypeError(f"loss_fn returned a complex loss ({loss.dtype}): a gradient needs a real one; return its real "
                        "part, magnitude or squared magnitude (loss.real, loss.abs(), (loss * loss.conj()).real)")


def _not_a_tensor(loss: object) -> TypeError:
    more = (": return the loss alone (a (loss, metrics) pair: pass lambda out, t: my_loss(out, t)[0])"
            if isinstance(loss, tuple | list | dict) else
            " (a number has no gradient: return the tensor, not loss.item())" if isinstance(loss, float | int) else "")
    return TypeError(f"loss_fn must return a torch.Tensor, got {type(loss).__name__}{more}")


def _check_scalars(losses: object, batch: int) -> torch.Tensor:
    if not isinstance(losses, torch.Tensor):
        raise _not_a_tensor(losses)
    _refuse_complex(losses)
    if losses.shape[:1] != (batch,) or losses[0].numel() != 1:
        raise _not_scalar(tuple(losses.shape[1:]))
    return losses.reshape(batch)


def per_sample_losses(loss_fn: LossFn, output: object, targets: object) -> torch.Tensor:
    """Loss of each sample, shape (B,), differentiable with respect to ``output``.

    ``output`` is (B, *out) from one batched forward (or a tuple / dict of such tensors, each with the samples
    first), ``targets`` is (B, ...). Element i equals ``loss_fn(output[i:i+1], targets[i:i+1])`` (every tensor
    of the output sliced alike).
    """
    if _fast_path_ok(loss_fn, output, targets):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        terms = unreduced(output, targets)
        terms = terms.reshape(terms.shape[0], -1)
        return terms.sum(1) if loss_fn.reduction == "sum" else terms.mean(1)
    given = [t for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor) and t.dim()]  # 0-dim: shared
    if given:
        batch = given[0].shape[0]
    else:  # no targets (a loss of the output alone): the samples are the output's first dimension
        first = next((t for t in tree_flatten(as_pytree(output))[0] if isinstance(t, torch.Tensor) and t.dim()), None)
        if first is None:
            raise ValueError("targets=None, and the model's output holds no tensor with the samples first (B, ...): "
                             "pass targets (B, ...), or return the per-sample outputs the loss reads")
        batch = first.shape[0]
    own = sequence_loss(loss_fn)
    if own is not None and isinstance(targets, torch.Tensor):  # one mean per sample by construction: no vmap
        return _check_scalars(own(output, targets, reduction="none"), batch)
    output = as_pytree(output)
    dims = sample_dims(output, batch)
    try:
        by_sample = sample_dims(targets, batch)  # numbers, strings and 0-dim tensors beside the targets passed whole
        losses = torch.func.vmap(lambda o, t: loss_fn(from_pytree(_sample(o, None)), batch_of_one(t, by_sample)),
                                 in_dims=(dims, by_sample))(output, targets)
    except Exception:  # loss functions that vmap cannot batch (data-dependent control flow, .item(), ...)
        losses = None  # one sample at a time, below: outside this block, so that the loss's own error is raised alone
    if losses is None:
        each = [loss_fn(from_pytree(cut(output, slice(i, i + 1), batch)), cut(targets, slice(i, i + 1), batch))
                for i in range(batch)]
        wrong = [t for t in each if not isinstance(t, torch.Tensor)]
        if wrong:  # None, a tuple, a number
            raise _not_a_tensor(wrong[0])
        if any(t.dim() for t in each):
            return _check_scalars(torch.stack([t.reshape(-1) for t in each]), batch)
        losses = torch.stack(each)
    return _check_scalars(losses, batch)


def sequence_loss(loss_fn: LossFn) -> Callable | None:
    """:func:`causal_lm_loss` or :func:`sequence_classification_loss` where ``loss_fn`` is one of them, or a
    ``functools.partial`` of one binding nothing but ``reduction='mean'`` or ``'sum'``: their ``reduction='none'`` is
    the per-sample losses (on GPT-2's (32, 32) tokens 0.3 against 1.8 ms through vmap); else None."""
    func, keywords = loss_fn, {}
    if isinstance(loss_fn, functools.partial):
        if loss_fn.args:
            return None
        func, keywords = loss_fn.func, loss_fn.keywords
    if func not in (causal_lm_loss, sequence_classification_loss) or set(keywords) - {"reduction"}:
        return None
    return func if keywords.get("reduction", "mean") in ("mean", "sum") else None


def _sample(output: object, i: None) -> object:
    """One sample of a batched output under vmap, as a batch of one (unsqueezed)."""
    return tree_map(lambda t: t.unsqueeze(0) if isinstance(t, torch.Tensor) else t, output)


def summed_per_sample_loss(loss_fn: LossFn, output: object, targets: object) -> torch.Tensor:
    """``per_sample_losses(loss_fn, output, targets).sum()``, a scalar, in one call of ``loss_fn`` where
    the reduction allows: 'sum' is already that sum, and 'mean' over equally sized samples is it / B."""
    if _fast_path_ok(loss_fn, output, targets):
        total = loss_fn(output, targets)
        return total * output.shape[0] if loss_fn.reduction == "mean" else total
    return per_sample_losses(loss_fn, output, targets).sum()


# ------------------------------------------------------------------------------------- losses of fine-tuned models

IGNORE_INDEX = -100  # Hugging Face's label for a token without a target (padding, the prompt)


def logits_of(output: object) -> torch.Tensor:
    """The logits of a model's output: the tensor itself, ``output.logits`` (a Hugging Face ``ModelOutput``, any
    object with that attribute) or ``output["logits"]`` (a dict)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise TypeError("expected logits: a tensor, or an output with .logits or ['logits'], got "
                        f"{type(output).__name__}")
    return logits


def causal_lm_loss(output: object, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy of a causal language model, one mean per sample.

    ``output``: logits (B, T, V), or a model output holding them (see :func:`logits_of`); ``labels`` (B, T) token
    ids, ``-100`` where a position has no target. Position t predicts ``labels[:, t + 1]`` (the shift by one is done
    here, as in Hugging Face's models, so ``labels`` may be the ``input_ids`` with padding set to -100).

    The loss of sample i is the mean of its own non-ignored tokens' losses (0 for a sample without any). This is the
    per-sample definition, ``loss(output[i:i+1], labels[i:i+1])``, and it differs from the token mean of a batch that
    Hugging Face's ``model(..., labels=...)`` returns, which weights each sample by its number of tokens (a sample
    with more tokens counts more) and so is not a sum of per-sample losses. ``reduction``: "mean" (default: the mean
    over samples of the per-sample losses), "sum", or "none" ((B,) per-sample losses).
    """
    logits = logits_of(output)
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise ValueError(f"causal_lm_loss needs logits (B, T, V) and labels (B, T), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    shifted = labels[:, 1:]
    batch, tokens, vocab = logits.shape
    # one row of V logits a position: 2.2x faster forward and backward than over a transposed (B, V, T - 1) view
    # (GPT-2's (32, 31, 1000) logits on 2 threads: 1.8 against 4.0 ms)
    terms = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), shifted.reshape(-1), ignore_index=IGNORE_INDEX,
                            reduction="none").view(batch, tokens - 1)  # (B, T - 1), 0 where ignored
    counts = (shifted != IGNORE_INDEX).sum(1).clamp_min(1)
    return _reduce(terms.sum(1) / counts, reduction)


PROBLEM_TYPES = ("regression", "single_label_classification", "multi_label_classification")


def sequence_classification_loss(output: object, labels: torch.Tensor, reduction: str = "mean",
                                 problem_type: str | None = None) -> torch.Tensor:
    """The loss of a Hugging Face ``...ForSequenceClassification`` head, one term per sample, chosen as its own is
    (its ``config.problem_type``; where that is unset, by Hugging Face's rule: ``num_labels=1`` is a regression,
    integer labels one class, float labels several): ``"regression"``, the squared error of logits (B, C) (or a model
    output holding them, see :func:`logits_of`) against values of the same size ((B,) for C = 1), its mean over the
    C outputs; ``"single_label_classification"``, the cross-entropy against class indices (B,);
    ``"multi_label_classification"``, the binary cross-entropy against float labels (B, C), its mean over the C
    classes. So the loss of sample i is its own. A head whose config names another problem type than that rule
    gives: pass it, ``loss_fn=functools.partial(pv.sequence_classification_loss, problem_type=config.problem_type)``.
    ``reduction`` as for :func:`causal_lm_loss`."""
    logits = logits_of(output)
    if problem_type is None:
        problem_type = PROBLEM_TYPES[0 if logits.dim() == 2 and logits.shape[1] == 1 else
                                     2 if labels.is_floating_point() else 1]
    if problem_type not in PROBLEM_TYPES:
        raise ValueError(f"problem_type must be one of {PROBLEM_TYPES} (a head's config.problem_type), got "
                         f"{problem_type!r}")
    # labels not rounded to a bfloat16 head's precision (float32 labels; integers, which would promote to bfloat16)
    wide = torch.promote_types(torch.promote_types(logits.dtype, labels.dtype), torch.float32)
    if logits.dim() == 2 and problem_type != PROBLEM_TYPES[1] and labels.numel() == logits.numel():
        pairs = logits.to(wide), labels.reshape(logits.shape).to(wide)
        if problem_type == PROBLEM_TYPES[0]:  # Hugging Face's MSELoss: the mean over all B x C values
            per_sample = (pairs[0] - pairs[1]).square().mean(1)
        else:
            per_sample = F.binary_cross_entropy_with_logits(*pairs, reduction="none").mean(1)
    elif (logits.dim() != 2 or labels.shape != logits.shape[:1] or labels.is_floating_point()
          or problem_type != PROBLEM_TYPES[1]):
        raise ValueError(f"sequence_classification_loss ({problem_type}) needs logits (B, C) and class indices (B,) "
                         f"(integers: labels.long()), or labels of the logits' size for a regression or several "
                         f"labels a sample, got {tuple(logits.shape)} and {tuple(labels.shape)} {labels.dtype}")
    else:
        per_sample = F.cross_entropy(logits, labels, reduction="none")
    return _reduce(per_sample, reduction)


def _reduce(per_sample: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "mean":
        return per_sample.mean()
    if reduction == "sum":
        return per_sample.sum()
    if reduction == "none":
        return per_sample
    raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
