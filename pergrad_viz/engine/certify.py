"""The per-call check: every row of a result against references computed independently of the strategy.

No probe of a few samples can prove that a fast path is right for every batch (rows reordered inside ``forward`` in
a way a pair does not show, a coupling through a batch statistic that only some inputs trigger, code that depends
on the batch size, a wrong rule, a wrong batching rule inside ``torch.func``, a plan gone stale). So results are
checked against the definition, when :mod:`pergrad_viz.engine.schedule` says a call is due (its first calls, then
within 10% of the time spent):

* **every row at once** (``hooks``, ``autograd_stack``, ``batched_grad``): with random weights w (B,) (for a
  Jacobian W (B, Y)), ``sum_i w_i G_i`` from the result, per parameter tensor, against the gradient of
  ``sum_i w_i L_i`` from one plain forward and backward of the batch (no hooks, no rules: the loop's own backward,
  batched). A row that is wrong by a relative e in any parameter tensor changes the combination by ``|w_i| e`` of
  that row's size, so a single wrong or misplaced row is caught with probability above 1/2 per checked call once
  its error is a few times the tolerance (a whole wrong row: about 0.9 and more).
* **one sample alone** (the same strategies): sample i, drawn from the check's own generator, runs alone and its
  gradient (a random combination ``u^T J_i`` of its Jacobian) is compared with row i: couplings between samples,
  which a batched reference shares with a batched strategy, show here (they touch every row).
* **every row by forward mode** (``torch_func``): ``vmap`` over the samples, each alone, of a ``jvp`` along a random
  direction v, against ``G_i . v`` (``J_i v``) from the result. Forward-mode formulas are independent of the
  backward ones ``vmap(grad)`` batches (PyTorch's own batching of ``cdist``'s backward is wrong; its ``jvp`` is
  not). The direction is scaled per parameter tensor by that tensor's size in the result, so that a wrong small
  tensor (a bias) counts as much as a wrong large one. A suspect row is then checked alone, as above.
* ``loop`` is the definition: nothing to compare it with.

No false alarm from rounding: a difference above the tolerance (relative 1e-6 in float64, 1e-3 in float32, 5e-2 in
half precision, per parameter tensor) is only a suspicion in a precision below float64. The reference is then
computed again in float64 on a float64 copy of the model, and the result fails only where it is further from that
exact value than the tolerance and 8 times as far as the reference in the result's precision is: where a float32
reduction cancels (a first convolution under batch norm can lose 2 digits), the float32 loop is as far off, and
the result passes. Where no float64 copy can be made, a suspicion fails beyond 30 times the tolerance. A sample
whose gradient is 0 (its loss at its minimum: the batch and the sample alone round to 0 and 1e-16) is measured
against 1e-3 of the batch's largest row, as the directional check measures every row (``engine/verdict.py``).

A failed check raises :class:`~pergrad_viz.errors.CheckFailedError` (``auto`` then hands over, and the plan
remembers it: where a plain backward of the batch gives the checked sample its own value, or the strategy's rows do
not combine to that backward's, the strategy alone is wrong and refused; else the samples interact, and every
strategy that runs the batch at once is refused). The check draws its random numbers from a generator of its own:
the caller's state is untouched.
"""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Callable, Mapping

import torch

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.float64 import float64_copy, to_float64
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.forward_mode import direction_scale, jvp_each, screened_jvp, without_padding_rows
from pergrad_viz.engine.references import (
    Tensors,
    alone_combination,
    alone_grads,
    alone_loss,
    in_its_batch_loss,
    norms_of_grads,
    replayed_weighted_grads,
    weighted_grads,
    weighted_outputs,
)
from pergrad_viz.engine.verdict import tolerance, verdict, worst_row
from pergrad_viz.errors import CheckFailedError

__all__ = ["CheckFailedError", "Float64Copies", "check_grads", "check_jacobian", "check_norms", "draw",
           "raise_if_failed", "random_normal"]

_DRAW = random.Random(int.from_bytes(os.urandom(8), "little"))  # private: the caller's random state is not touched


def draw(batch: int) -> int:
    """A sample index in [0, batch), uniformly, from the check's own generator."""
    return _DRAW.randrange(batch)


def random_normal(shape: tuple, like: torch.Tensor) -> torch.Tensor:
    gen = torch.Generator(device=like.device).manual_seed(_DRAW.getrandbits(62))
    return torch.randn(shape, generator=gen, dtype=like.dtype, device=like.device)


def raise_if_failed(found: tuple[str, float] | None, where: str, strategy: str,
                    coupled: Callable[[], bool] | bool = False, random: bool = False, why: str | None = None) -> None:
    """Raise :class:`CheckFailedError` where ``found`` (the verdict). ``coupled``: whether the failure shows the
    samples interacting in a batched forward (asked only on failure); else the strategy is wrong on its own (its
    result is not the plain batched backward's, or that backward keeps the sample apart), and only it is demoted.
    ``random``: under ``randomness='different'``, where a coupling and draws the strategy cannot replay look alike.
    ``why``: the message's explanation where the caller knows it better (else one of the three above)."""
    if found is None:
        return
    name, relative = found
    coupled = coupled() if callable(coupled) else coupled
    reason = (f"the per-call check found that {where} from the {strategy} strategy differs from the definition "
              f"(parameter '{name}': relative difference {relative:.1e}, beyond rounding)")
    what = why or (_RANDOM_WHY if random and coupled else _BATCHED_WHY if coupled else
                   _OWN_WHY.format(strategy=strategy))
    fix = ("strategy='auto' or 'loop' (each sample alone, under its own draws)" if random else
           "strategy='auto' (which then computes each sample alone) or 'torch_func' / 'loop'")
    raise CheckFailedError(f"{reason}: {what}. Use {fix}.", reason=reason, coupled=coupled)


def _coupled(trainable: Trainable, want: Tensors, in_batch: Callable[[], tuple[Tensors, Tensors] | None] | None
             ) -> Callable[[], bool]:
    """Whether the sample's value from a plain backward of its whole batch (``in_batch``) is not ``want`` (the
    sample alone): the samples interact; True where that cannot be had."""
    def coupled() -> bool:
        both = None if in_batch is None else in_batch()
        return both is None or verdict(trainable.names, both[0], want, trainable.dtype, lambda: None) is not None

    return coupled


_BATCHED_WHY = ("this model's forward does not keep the samples apart in a way the probe of a few samples could see "
                "(rows reordered inside forward, a batch statistic, code that depends on the batch size, a coupling "
                "in a custom backward, or a model changed since its plan was made)")
_OWN_WHY = ("the {strategy} strategy computes something else than a plain backward of the batch does here (an "
           "operation whose batched backward under torch.func is wrong, such as PyTorch's vmap of cdist's, on a layer "
           "taking the per-layer fallback; or a layer rule that does not fit this layer)")
_RANDOM_WHY = ("under randomness='different' the check, which draws the batch's random numbers again, cannot tell a "
               "layer whose draws this strategy makes otherwise (the dropout inside nn.MultiheadAttention or nn.LSTM) "
               "from samples that interact")


# --------------------------------------------------------------------------------------- float64 references


class Float64Copies:
    """A check's call (model, inputs, targets, loss) and its float64 copies, made once, at the first reference asked
    in float64 (a sample-alone check may ask for two: the sample alone and in its batch)."""

    def __init__(self, trainable: Trainable, inputs: Batch, targets: object, loss_fn: LossFn | None):
        self.call = (trainable, inputs, targets, loss_fn)
        self._copies: tuple | None = None

    def run(self, compute: Callable[[Trainable, Batch, object, LossFn | None], Tensors]) -> Tensors | None:
        """``compute`` on the float64 copies; None where they cannot be made or the model does not run in float64."""
        if self._copies is None:
            trainable, inputs, targets, loss_fn = self.call
            copied = float64_copy(trainable)
            loss = copy.deepcopy(loss_fn).double() if isinstance(loss_fn, torch.nn.Module) else loss_fn
            self._copies = () if copied is None else (copied, inputs.map(to_float64), to_float64(targets), loss)
        if not self._copies:
            return None
        try:
            return [g.double() for g in compute(*self._copies)]
        except (RuntimeError, TypeError, ValueError):  # the model does not run in float64 (a dtype hard-coded)
            return None

    def again(self, compute: Callable[..., Tensors]) -> Callable[[], Tensors | None]:
        """``compute`` again in float64, for :func:`verdict`'s ``exact`` (asked only on a suspicion)."""
        return lambda: self.run(compute)

    def in_batch(self, compute: Callable[..., Tensors]) -> Callable[[], tuple[Tensors, Tensors] | None]:
        """``compute`` (a sample's value from a forward of its whole batch) in the result's precision and in float64,
        for :func:`verdict`'s ``in_batch``."""
        return lambda: None if (high := self.run(compute)) is None else (compute(*self.call), high)


# ------------------------------------------------------------------------------------------------ the checks


def check_grads(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
                rows: Mapping[str, torch.Tensor], strategy: str, batched: bool = True, own_forward: bool = True
                ) -> None:
    """Raise :class:`CheckFailedError` unless ``rows`` {name: (B, *param.shape)} are the per-sample gradients
    (see the module docstring; ``batched``: a plain backward of the batch is a valid reference, the strategy ran
    the model once on the whole batch or the plan found the samples apart; ``own_forward``: the former)."""
    if not batched:
        _check_directional(trainable, loss_fn, inputs, targets, rows, strategy)
        return
    lead = trainable.params[0]
    w = random_normal((inputs.size,), lead)
    got = [torch.tensordot(w, rows[name], dims=1) for name in trainable.names]
    want, again = weighted_reference(trainable, loss_fn, inputs, targets, w)
    found = verdict(trainable.names, got, want, trainable.dtype, again)
    if trainable.call.draws is not None:  # randomness='different': the reference drew the strategy's numbers again
        raise_if_failed(found, "a random combination of the rows (the same random draws)", strategy)
        return  # a sample alone would draw other numbers: couplings are the probe's, with the draws held fixed
    alone = lambda: _check_alone(trainable, loss_fn, inputs, targets, rows, strategy, draw(inputs.size))  # noqa: E731
    if found is not None and not own_forward and (_batch_coupled(trainable, alone()) or _every_row_alone(
            trainable, lambda: _check_directional(trainable, loss_fn, inputs, targets, rows, strategy))):
        return
    raise_if_failed(found, "a random combination of the rows", strategy)
    alone()
    if own_forward:  # every row alone by forward mode: a coupling that moves a few rows without a cross term
        _check_directional(trainable, loss_fn, inputs, targets, rows, strategy, screen=True)


def weighted_reference(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object, w: torch.Tensor
                       ) -> tuple[Tensors, Callable[[], Tensors | None]]:
    """(the gradient of ``sum_i w_i L_i`` from one plain backward of the batch, the same in float64 on demand),
    under ``randomness="different"`` each chunk's draws replayed: the reference of every row at once."""
    draws = trainable.call.draws
    if draws is None:
        def compute(t: Trainable, x: Batch, y: object, f: LossFn | None) -> Tensors:
            return weighted_grads(t, x, y, f, w)
    else:
        def compute(t: Trainable, x: Batch, y: object, f: LossFn | None) -> Tensors:
            return replayed_weighted_grads(draws, t, x, y, f, w)
    return compute(trainable, inputs, targets, loss_fn), Float64Copies(trainable, inputs, targets, loss_fn).again(
        compute)


def _batch_coupled(trainable: Trainable, coupled: Callable[[], bool]) -> bool:
    """After a strategy that computes each sample alone failed the batched reference and passed a sample alone:
    whether a plain backward of the batch gives that sample another value (``coupled``), so that the reference,
    not the strategy, is wrong (a forward that depends on the batch size, which a probe of two samples misses); the
    plan then refuses every strategy that runs the batch at once."""
    if not coupled():
        return False
    if trainable.call.plan is not None:
        trainable.call.plan.interacting("the per-call check found a plain backward of the batch giving a sample "
                                        "another gradient than it has alone (a forward that depends on the batch "
                                        "size?)")
    return True


def _every_row_alone(trainable: Trainable, directional: Callable[[], bool]) -> bool:
    """After a strategy that computes each sample alone failed the batched reference and passed a random sample alone
    that the batch does not couple: whether every row passes forward mode's check of its sample alone
    (``directional()``, which raises where a row fails), so that the samples the batch couples are others (a forward
    that normalises by the batch's largest value only once some sample is large); the plan then refuses every
    strategy that runs the batch at once, as :func:`_batch_coupled` does."""
    return directional() and _batch_coupled(trainable, lambda: True)


def _check_alone(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
                 rows: Mapping[str, torch.Tensor], strategy: str, i: int) -> Callable[[], bool]:
    """Row i against sample i alone; where it passes, whether a plain backward of the batch couples the sample."""
    compute = alone_grads(i)
    want = compute(trainable, inputs, targets, loss_fn)
    got = [rows[name][i] for name in trainable.names]
    copies = Float64Copies(trainable, inputs, targets, loss_fn)
    in_batch = copies.in_batch(alone_grads(i, in_batch=True))
    coupled = _coupled(trainable, want, in_batch)
    raise_if_failed(verdict(trainable.names, got, want, trainable.dtype, copies.again(compute), in_batch,
                            lambda: 1e-3 * float(torch.stack([rows[name].flatten(1).norm(dim=1)
                                                              for name in trainable.names]).norm(dim=0).max())),
                    f"sample {i}'s gradient", strategy, coupled)
    return coupled


def check_jacobian(trainable: Trainable, inputs: Batch, rows: Mapping[str, torch.Tensor], strategy: str,
                   batched: bool = True, own_forward: bool = True) -> None:
    """Raise :class:`CheckFailedError` unless ``rows`` {name: (B, Y, *param.shape)} are the per-sample Jacobians."""
    if not batched:
        _check_directional(trainable, None, inputs, None, rows, strategy)
        return
    first = rows[trainable.names[0]]
    w = random_normal(tuple(first.shape[:2]), first)
    got = [torch.tensordot(w, rows[name], dims=2) for name in trainable.names]
    want = weighted_outputs(trainable, inputs, None, None, w)
    again = Float64Copies(trainable, inputs, None, None).again(lambda t, x, y, f: weighted_outputs(t, x, y, f, w))
    found = verdict(trainable.names, got, want, trainable.dtype, again)
    alone = lambda: _check_alone_jacobian(trainable, inputs, rows, strategy, draw(inputs.size))  # noqa: E731
    if found is not None and not own_forward and (_batch_coupled(trainable, alone()) or _every_row_alone(
            trainable, lambda: _check_directional(trainable, None, inputs, None, rows, strategy))):
        return
    raise_if_failed(found, "a random combination of the Jacobians' rows", strategy)
    alone()
    if own_forward:
        _check_directional(trainable, None, inputs, None, rows, strategy, screen=True)


def _check_alone_jacobian(trainable: Trainable, inputs: Batch, rows: Mapping[str, torch.Tensor], strategy: str,
                          i: int) -> Callable[[], bool]:
    first = rows[trainable.names[0]]
    u = random_normal((first.shape[1],), first)
    compute = alone_combination(i, u)
    want = compute(trainable, inputs, None, None)
    got = [torch.tensordot(u, rows[name][i], dims=1) for name in trainable.names]
    copies = Float64Copies(trainable, inputs, None, None)
    in_batch = copies.in_batch(alone_combination(i, u, in_batch=True))
    coupled = _coupled(trainable, want, in_batch)
    raise_if_failed(verdict(trainable.names, got, want, trainable.dtype, copies.again(compute), in_batch),
                    f"sample {i}'s Jacobian (a random combination of its rows)", strategy, coupled)
    return coupled


def _check_directional(trainable: Trainable, loss_fn: LossFn | None, inputs: Batch, targets: object,
                       rows: Mapping[str, torch.Tensor], strategy: str, screen: bool = False) -> bool:
    """Every row against a forward-mode directional derivative of that sample alone (``vmap`` of ``jvp``); the worst
    row beyond the tolerance, if any, is then checked alone. Where forward mode cannot run the model, one random
    row is checked alone (``screen``: none, and nothing it raises or warns reaches the caller). Returns whether
    every row passed by forward mode."""
    jacobian = loss_fn is None
    lead = 2 if jacobian else 1
    batch = inputs.size
    blocks = [rows[name].reshape(*rows[name].shape[:lead], -1) for name in trainable.names]  # (B, [Y,] n_k)
    block_norms = torch.stack([b.flatten(1).norm(dim=1) for b in blocks], 1)  # (B, K)
    scale = direction_scale(block_norms.square().mean(0))  # (K,): each tensor's part relative to its size
    tangents = without_padding_rows(trainable, {name: random_normal(tuple(p.shape), p) * scale[k] for k, (name, p)
                                                 in enumerate(zip(trainable.names, trainable.params, strict=True))})
    if screen:
        derivative = screened_jvp(trainable, loss_fn, inputs, targets, tangents)
        if derivative is None:
            return False
    else:
        try:
            derivative = jvp_each(trainable, loss_fn, inputs, targets, tangents)  # (B,) or (B, Y)
        except (RuntimeError, NotImplementedError):  # no forward-mode formula, or vmap cannot run the model
            derivative = None
    i = draw(batch)
    if derivative is not None:
        got = sum(torch.einsum("b...p,p->b...", b, tangents[n].reshape(-1)) for b, n in zip(blocks, trainable.names,
                                                                                             strict=True))
        worst = worst_row((got - derivative).reshape(batch, -1).norm(dim=1),
                          (block_norms * scale).square().sum(1).sqrt(), tolerance(trainable.dtype, trainable.device))
        if worst is None:
            return True
        i = worst
    if jacobian:
        _check_alone_jacobian(trainable, inputs, rows, strategy, i)
    else:
        _check_alone(trainable, loss_fn, inputs, targets, rows, strategy, i)
    return False


def check_norms(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
                squared: Mapping[str, torch.Tensor], strategy: str, i: int | None = None) -> None:
    """Raise :class:`CheckFailedError` unless entry i of ``squared`` {name: (B,)} is the squared norm of sample i's
    gradient, per parameter, for sample i (by default a random one)."""
    i = draw(inputs.size) if i is None else i
    draws = trainable.call.draws
    loss_of = alone_loss(i) if draws is None else in_its_batch_loss(draws, i)

    def norms_of(t: Trainable, x: Batch, y: object, f: LossFn | None) -> Tensors:
        return norms_of_grads(loss_of(t, x, y, f), t.params)  # one parameter's gradient alive at a time

    want = norms_of(trainable, inputs, targets, loss_fn)
    got = [squared[name][i].clamp_min(0).sqrt().reshape(1).to(w.dtype) for name, w in zip(trainable.names, want,
                                                                                          strict=True)]
    copies = Float64Copies(trainable, inputs, targets, loss_fn)
    in_batch = None if draws is not None else copies.in_batch(
        lambda t, x, y, f: norms_of_grads(alone_loss(i, in_batch=True)(t, x, y, f), t.params))
    def floor() -> float:
        return 1e-3 * float(sum(squared[name] for name in trainable.names).clamp_min(0).max().sqrt())

    raise_if_failed(verdict(trainable.names, got, want, trainable.dtype, copies.again(norms_of), in_batch, floor),
                    f"sample {i}'s gradient norm", strategy, _coupled(trainable, want, in_batch),
                    random=draws is not None)
