"""Small pieces the strategies share."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.guards import (
    REENTRANT_CHECKPOINT,
    check_output_count,
    nothing_takes_part,
    noting_reentrant_layers,
)
from pergrad_viz.core.layout import sample_rows
from pergrad_viz.core.randomness import random_fix
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.engine.observe import forked_random, observe
from pergrad_viz.errors import UndefinedPerSampleError, UnsupportedModelError


def write(out: dict[str, torch.Tensor], names: Sequence[str], grads: Sequence[torch.Tensor | None],
          index: int | tuple[int, ...] | slice) -> None:
    """``out[name][index] = grad`` for each parameter; a parameter the output does not use gets zeros."""
    for name, g in zip(names, grads, strict=True):
        if g is None:
            out[name][index].zero_()
        else:
            out[name][index].copy_(g.to_dense() if g.is_sparse else g)  # e.g. nn.Embedding(sparse=True)


def non_finite_rows(out: dict[str, torch.Tensor]) -> list[int]:
    """The samples i whose rows ``out[name][i]`` (B, ...) hold a NaN or an inf. After one batched backward these
    may come from another sample (its inf activation times this sample's zero gradient in a weight's product): the
    batched strategies recompute them alone."""
    rows = None
    for t in out.values():
        finite = sample_rows(t).isfinite().all(1)
        rows = finite if rows is None else rows & finite
    return [] if rows is None else (~rows).nonzero().flatten().tolist()


def mark_draws(trainable: Trainable, inputs: Batch) -> None:
    """Under ``randomness="different"``, note the random state a batched forward of ``inputs`` starts from, so that
    the per-call check can draw the same numbers again (``pergrad_viz.core.randomness.Draws``)."""
    if trainable.call.draws is not None:
        trainable.call.draws.mark(inputs.size)


def refuse_random_forward(trainable: Trainable, inputs: Batch) -> None:
    """Refuse, with :class:`UndefinedPerSampleError`, a forward that draws random numbers (stochastic depth such as
    timm's ``drop_path_rate``, ``F.dropout(..., training=True)``, noise): one forward of the first sample, watched for
    the operations PyTorch tags as seeded, under a forked RNG (the caller's random state is untouched), before a
    strategy that does not probe (the loop, torch_func) runs the model; the batched ones refuse at the probe. Under
    ``randomness="different"`` (``trainable.call.draws``) nothing is refused."""
    if trainable.call.draws is not None:
        return
    if any(isinstance(m, torch.jit.ScriptModule) for _, m in trainable.modules):
        return  # TorchScript takes no hooks to watch it with (and runs in the loop only)
    with restoring_modes(trainable, keep_parameters=True), torch.no_grad(), forked_random(trainable.device):
        _, drew = observe(trainable, inputs.sample(0), None, random_ops=True)
    if drew is not None:
        module = dict(trainable.modules)[drew]
        raise UndefinedPerSampleError(
            f"the forward draws random numbers (first in layer '{drew or 'model'}' ({type(module).__name__}): "
            "stochastic depth such as timm's drop_path_rate, dropout written as F.dropout(..., training=True), "
            "noise), so per-sample gradients would be random and not comparable, whatever the strategy. "
            f"{random_fix(trainable, 'turn the randomness off, e.g. drop_path_rate=0')}.")


def refuse_reentrant_forward(trainable: Trainable, sample: Batch) -> None:
    """Where a parameter got no gradient: :class:`UnsupportedModelError` if a layer holding trainable parameters runs
    inside a reentrant checkpoint on inputs that require no grad (no trace of it in the graph: PyTorch gives its
    layers nothing, as the loop did, zeros), found by one more forward of the sample."""
    device = trainable.device
    with restoring_modes(trainable), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            noting_reentrant_layers() as found:
        sample(trainable.model)
    if any(p.requires_grad for m in found for p in m.parameters()):
        raise UnsupportedModelError(REENTRANT_CHECKPOINT)


def check_some_take_part(trainable: Trainable, result: torch.Tensor, inputs: Batch, what: str = "loss") -> None:
    """:func:`~pergrad_viz.core.guards.check_takes_part` of a strategy's batched ``result``; where no parameter takes
    part, first whether a reentrant checkpoint on inputs that require no grad hid them (one more forward of sample
    0: :func:`refuse_reentrant_forward` names ``use_reentrant=False``, not a merged adapter)."""
    if isinstance(result, torch.Tensor) and not result.requires_grad:
        raise nothing_took_part(trainable, inputs, what)


def nothing_took_part(trainable: Trainable, inputs: Batch, what: str = "loss") -> ValueError:
    """The error of a call in which no trainable parameter took part, once :func:`refuse_reentrant_forward` has found
    no reentrant checkpoint on sample 0 (where one hid them, it raises naming ``use_reentrant=False``)."""
    if inputs.size:
        refuse_reentrant_forward(trainable, inputs.sample(0))
    return nothing_takes_part(trainable, what)


def check_batch_output_count(y_count: int, out: dict[str, torch.Tensor]) -> None:
    """Refuse a batched forward giving ``y_count`` output elements a sample where sample 0 alone gave the Y of ``out``
    ({name: (B, Y, ...)}, sized by ``api.output_size``)."""
    check_output_count("a sample in the batch", y_count, next(iter(out.values())).shape[1], "sample 0 alone")
