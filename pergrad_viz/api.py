"""The public entry points: validate, estimate memory, guard the model, dispatch to a strategy.

Shapes: B samples, P trainable scalars (all parameters with ``requires_grad``, in
``named_parameters()`` order), Y output elements per sample (an output (B, *out) is flattened).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from pergrad_viz.core.batch import Batch, Inputs, cut, normal_tensor
from pergrad_viz.core.guards import (
    check_apart_from_parameters,
    check_autocast,
    check_differentiated,
    check_one_dtype,
    special_model_strategy,
)
from pergrad_viz.core.layout import flat_views
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.memory import check_budget, empty_result, result_bytes
from pergrad_viz.core.randomness import Draws, check_randomness, randomness_of, refuse_torch_func
from pergrad_viz.core.trainable import Trainable, computing_gradients, restoring_modes
from pergrad_viz.core.users import users_error
from pergrad_viz.core.validate import (
    batch_of,
    check_chunk,
    check_flags,
    check_inputs_kept,
    check_loss,
    check_modes,
    check_out,
    check_out_memory,
    check_strategy_name,
    check_unlabelled_batch,
)
from pergrad_viz.engine.capture import check_supported
from pergrad_viz.engine.certify import check_grads, check_jacobian
from pergrad_viz.engine.observe import forked_random
from pergrad_viz.engine.probe import plan_for
from pergrad_viz.engine.schedule import Race, race_for, schedule_for, seen_graphs, unseen_graphs
from pergrad_viz.errors import (
    CheckFailedError,
    HandOverError,
    MemoryBudgetError,
    UndefinedPerSampleError,
    UnsupportedModelError,
)
from pergrad_viz.strategies import REGISTRY, STRATEGIES, Strategy, working_bytes

Result = dict[str, torch.Tensor] | torch.Tensor
R = TypeVar("R")


def resolve_strategy(strategy: str, model: nn.Module | Trainable, inputs: Inputs | Batch | None = None) -> str:
    """The strategy a call on ``model`` with ``inputs`` (B, ...; or a tuple / dict of tensors, see
    :mod:`pergrad_viz.core.batch`) will use.

    ``auto`` is ``hooks`` (closed-form layer rules, and the per-layer fallback for layers without one) unless a probe
    of the model on two samples (cached per model and input signature, ``pergrad_viz.engine.probe``) finds that the
    samples interact, that a layer with trainable parameters does not keep them apart (a positional embedding
    broadcast over the batch), or a parameter used outside its layer's forward: then ``torch_func``, which computes
    each sample alone. Without ``inputs`` nothing is probed and ``auto`` answers ``hooks``.

    Raises ValueError for an unknown name; :class:`UnsupportedModelError` when ``hooks``, ``autograd_stack`` or
    ``batched_grad`` (one batched forward pass) would not give the per-sample definition for these inputs."""
    check_strategy_name(strategy, STRATEGIES)
    trainable = model if isinstance(model, Trainable) else Trainable.of(model)
    if inputs is not None:
        inputs = inputs if isinstance(inputs, Batch) else Batch.of(inputs).map(normal_tensor)
        check_modes(trainable, randomness_of(trainable))  # before the probe runs the model
    special = special_model_strategy(trainable, strategy)
    if special is not None:
        return special
    refuse_torch_func(trainable, strategy)
    lower = None if inputs is None or strategy == "loop" else plan_for(trainable, inputs).lower_precision
    if lower is not None and strategy == "auto":
        return "loop"  # each sample alone, as the forward's own autocast runs it
    if lower is not None:
        raise UnsupportedModelError(
            f"{lower} while the parameters are {trainable.dtype} (torch.autocast inside the forward): the {strategy} "
            "strategy's batched computation rounds there otherwise than each sample alone. Use strategy='auto' or "
            "'loop' (each sample alone, as the forward runs it)")
    if strategy == "auto":
        try:
            check_supported(trainable, inputs)
            return "hooks"
        except UndefinedPerSampleError:
            raise
        except UnsupportedModelError:
            usable = randomness_of(trainable) == "error" and "torch_func" not in plan_for(trainable, inputs).failed
            return "torch_func" if usable else "loop"
    if strategy == "hooks":
        check_supported(trainable, inputs)
    elif inputs is not None and (strategy == "torch_func" or REGISTRY[strategy].batched_forward):
        interaction = plan_for(trainable, inputs).interaction  # torch_func too: the probe refuses a stale graph
        if interaction is not None and strategy != "torch_func":
            raise UnsupportedModelError(
                f"the {strategy} strategy runs the model once on the whole batch, which cannot give each sample's "
                f"own gradient here: {interaction}. Per-sample gradients are defined by each sample alone: use "
                "strategy='auto' (torch_func, or the loop where torch.func cannot run the model), 'torch_func' or "
                "'loop'."
            )
    return strategy


def _run(trainable: Trainable, strategy: str, run_chunk: Callable, batch: int, chunk: int, outputs: int | None,
         flat: bool, out: torch.Tensor | None) -> Result:
    lead = (batch,) if outputs is None else (batch, outputs)
    kw = {"dtype": trainable.dtype, "device": trainable.device}
    with restoring_modes(trainable):  # also: the result is a normal tensor under the caller's inference_mode
        if flat:
            result = empty_result((*lead, trainable.num_params), **kw) if out is None else out
            views = flat_views(result, trainable.shapes, lead)
        else:
            result = {name: empty_result((*lead, *shape), **kw) for name, shape in trainable.shapes.items()}
            views = result
        trainable.call.rows = (result, views)  # for the per-call check (_rows)
        for start in range(0, batch, chunk):
            stop = min(start + chunk, batch)
            rows = views if chunk == batch else {n: v[start:stop] for n, v in views.items()}
            run_chunk(REGISTRY[strategy], slice(start, stop), rows)
    return result


def _check_memory(trainable: Trainable, strategy: str, batch: int, chunk: int, outputs: int | None,
                  max_bytes: int | None, out: torch.Tensor | None) -> bool:
    """:class:`MemoryBudgetError` before anything is allocated where the result (B, [Y,] P) and ``strategy``'s working
    memory for a chunk would not fit ``max_bytes``. Returns whether ``torch_func``'s would fit too (then ``auto`` may
    time it against ``hooks``)."""
    p = trainable.num_params

    def check(used: str) -> None:
        what = (f"per-sample gradients of {batch} samples x {p:,} parameters" if outputs is None else
                f"per-sample Jacobians of {batch} samples x {outputs} outputs x {p:,} parameters")
        check_budget(what=what, result=result_bytes(batch, p, trainable.dtype, outputs or 1),
                     working=working_bytes(used, chunk, batch, p, trainable.dtype, outputs or 1,
                                           trainable.largest_param),
                     max_bytes=max_bytes, allocate_result=out is None, device=trainable.device, batch=batch,
                     chunk=chunk)

    check(strategy)
    if strategy != "hooks":
        return False
    try:
        check("torch_func")
    except MemoryBudgetError:
        return False
    return True


def prepare(model: nn.Module, inputs: Inputs, targets: object, strategy: str, chunk_size: int | None,
            loss_fn: object = None, model_kwargs: Mapping | None = None, out: torch.Tensor | None = None,
            flat: bool = True, randomness: str = "error", verify: bool = True, offers_randomness: bool = True,
            output: Callable[[object], torch.Tensor] | None = None) -> tuple[Trainable, str, Batch, int]:
    """A call checked (``pergrad_viz.core.validate``) and planned: ``(trainable, resolved strategy, batch (B, ...),
    samples per chunk)``; raises before anything runs or is allocated (but the probe, for ``auto``).
    ``offers_randomness``: the public call takes ``randomness=`` (its refusals may name it); ``output``: a
    Jacobian's ``output=`` (the probe sees what it selects); ``loss_fn``: None for a Jacobian, else checked by the
    public call first (``check_loss``, which refuses None)."""
    check_flags(flat=flat, verify=verify)
    check_strategy_name(strategy, STRATEGIES)  # before anything is checked or run
    check_randomness(randomness)
    trainable = Trainable.of(model) if output is None else Trainable.of(model).selecting(output)
    trainable.call.offers_randomness = offers_randomness
    if randomness == "different":
        trainable.call.draws = Draws(trainable.device)
    batch = batch_of(trainable, inputs, targets, model_kwargs)
    check_apart_from_parameters(trainable, batch.all_named_leaves(), targets)
    if targets is None and loss_fn is not None:
        check_unlabelled_batch(batch)
    trainable.call.input_versions = batch.versions(apart_from=out)
    chunk = check_chunk(chunk_size, batch.size)
    if out is not None:
        check_out_memory(out, trainable, flat, batch, targets, loss_fn)  # before the probe runs the model
    if check_autocast(strategy, trainable) or check_one_dtype(strategy, trainable):  # each sample alone, as it runs
        check_modes(trainable, randomness)
        return trainable, "loop", batch, chunk
    try:
        resolved = resolve_strategy(strategy, trainable, batch)  # the probe runs the model (auto, batched strategies)
    except Exception as e:
        check_inputs_kept(trainable)  # a probe that failed on inputs the forward wrote: that, first
        users_error(e, batch, targets)  # the model's own error: a note on the inputs it was called on
        raise
    check_inputs_kept(trainable)
    return trainable, resolved, batch, chunk


_CHAIN = {"hooks": ("hooks", "torch_func", "loop"), "torch_func": ("torch_func", "loop")}  # auto's hand-over


def hand_over(requested: str, resolved: str, trainable: Trainable, inputs: Batch, run: Callable[[str], R],
              check: Callable[[R, str], None] | None, quantity: str, targets: object = None,
              may_race: bool = True) -> R:
    """The package's one hand-over: run ``resolved`` and check its result when the schedule says the call is due
    (:mod:`pergrad_viz.engine.schedule`; ``check`` None: not asked for); under ``requested == "auto"`` a fast path
    that finds it cannot give the definition for this call (:class:`~pergrad_viz.errors.HandOverError`: the plan
    does not fit the call, torch.func cannot run the model, the check failed) hands over to the next of
    ``hooks -> torch_func -> loop``, and a failed check is remembered in the plan (later calls skip that strategy).
    An explicit strategy raises instead; any other error (the model's, the loss's, out of memory) is the user's and
    reaches the user unchanged, raised once, with a note on the inputs the package cut (see ``users_error``).

    Where the probe lets ``hooks`` run (and ``may_race``: ``torch_func``'s memory fits too), ``auto`` races it against
    ``torch_func`` on a few early calls and runs the faster from then on (:class:`~pergrad_viz.engine.schedule.Race`);
    both are checked alike.

    ``run(strategy)`` computes the result; ``quantity`` ("grads", "norms", ...) keys the check's schedule."""
    may_race = may_race and requested == "auto" and resolved == "hooks" and trainable.call.draws is None
    race = race_for(trainable, inputs, quantity) if may_race else None
    if race is not None:
        chain = (*race.order(), "loop")
    elif requested == "auto":
        chain = tuple(s for s in _CHAIN.get(resolved, (resolved,)) if s != "torch_func" or trainable.call.draws is None)
    else:
        chain = (resolved,)
    for k, strategy in enumerate(chain):
        try:
            result = _checked(strategy, trainable, inputs, run, check, quantity, race)
        except HandOverError as e:
            check_inputs_kept(trainable)  # a mismatch the forward's write to its inputs made: that, first
            if race is not None:
                race.lose(strategy)
            if k == len(chain) - 1:
                raise
            if isinstance(e, CheckFailedError) and trainable.select is None:  # not a finding of one output= only
                plan_for(trainable, inputs).demote(strategy, e.reason, REGISTRY[strategy].batched_forward, e.coupled)
        except Exception as e:
            check_inputs_kept(trainable)
            users_error(e, inputs, targets)  # the same error, a note added (core/users.py)
            raise
        else:
            check_inputs_kept(trainable)  # the forward left the inputs as it found them
            return result
    raise AssertionError("unreachable: the last strategy of a chain returns or raises")


def _checked(strategy: str, trainable: Trainable, inputs: Batch, run: Callable[[str], R],
             check: Callable[[R, str], None] | None, quantity: str, race: Race | None = None) -> R:
    if trainable.call.draws is not None:  # from the call's first random state (core.randomness.Draws)
        trainable.call.draws.begin()
    trainable.call.checked = check is not None and strategy != "loop"  # the loop is the definition; capture reads it
    schedule = schedule_for(trainable, inputs, quantity, strategy) if trainable.call.checked else None
    trainable.call.due, trainable.call.combination = schedule is not None and schedule.due(), None
    start = time.perf_counter()
    result = run(strategy)
    seconds = time.perf_counter() - start
    if race is not None:
        race.ran(strategy, seconds)
    if schedule is not None:
        unseen = unseen_graphs(trainable)
        if schedule.due() or unseen:
            with restoring_modes(trainable), schedule.checking():
                check(result, strategy)
            seen_graphs(trainable, unseen)
        schedule.computed(seconds, inputs.size)
    return result


def _apart(trainable: Trainable, strategy: str) -> bool:
    """Whether a plain batched backward is a valid reference for the check: ``strategy`` ran the model once on the
    whole batch, or the plan found the samples apart (``torch_func`` then checked so too, without forward mode)."""
    plan = trainable.call.plan
    return REGISTRY[strategy].batched_forward or (plan is not None and plan.interaction is None and plan.verified)


def _rows(result: Result, trainable: Trainable, lead: int) -> dict[str, torch.Tensor]:
    """{name: (B, [Y,] *param.shape)} views of a dict or flat result (``lead``: 1 for gradients, 2 for Jacobians)."""
    if isinstance(result, dict):
        return result
    made = trainable.call.rows
    if made is not None and made[0] is result:  # the views _run wrote through
        return made[1]
    return flat_views(result, trainable.shapes, tuple(result.shape[:lead]))


@computing_gradients
def per_sample_grads(model: nn.Module, loss_fn: LossFn, inputs: Inputs, targets: object, *,
                     strategy: str = "auto", flat: bool = False, chunk_size: int | None = None,
                     max_bytes: int | None = None, out: torch.Tensor | None = None, verify: bool = True,
                     model_kwargs: Mapping | None = None, randomness: str = "error") -> Result:
    """The gradient of each sample's loss with respect to every trainable parameter.

    The per-sample gradient of sample i is the gradient of ``loss_fn(model(inputs[i:i+1]), targets[i:i+1])``: what
    the naive loop computes, whatever ``loss_fn``'s reduction. With several inputs, sample i is cut from every tensor
    whose first dimension is the batch (``pergrad_viz.core.batch``): ``model(ids[i:i+1], attention_mask=mask[i:i+1])``.

    Args:
        model: any ``nn.Module``; left exactly as it was (no hooks, same parameters, ``.grad`` and modes).
        loss_fn: ``loss_fn(output, targets) -> scalar``, e.g. ``nn.CrossEntropyLoss()``; ``output`` is what the
            model returns (a tensor, a tuple, a dict or a Hugging Face ``ModelOutput``).
        inputs: (B, ...) on the model's device (integer dtype for Embedding models); or a tuple / list of tensors
            (``model(*inputs)``), or a dict / ``BatchEncoding`` (``model(**inputs)``), each tensor with B first
            except shared ones (a (T, T) mask, passed unchanged).
        targets: (B, ...), or a tuple / dict of (B, ...) tensors.
        strategy: ``"auto"`` or one of :data:`pergrad_viz.STRATEGIES`.
        flat: return one (B, P) tensor instead of a dict.
        chunk_size: process at most this many samples at a time, to bound working memory.
        max_bytes: memory budget (default: half of the memory available on the device).
        out: with ``flat=True``, a preallocated (B, P) tensor to write into (same dtype and device as
            the parameters); it is returned.
        verify: check the result against the definition (``engine.certify``), amortised (a plan's first calls, then
            10% of the time: ``engine.schedule``). ``False`` skips it: samples interacting in some batches go unseen.
        model_kwargs: more keyword arguments for the model, cut like the inputs.
        randomness: ``"error"`` (refuse a forward that draws random numbers) or ``"different"`` (row i: sample i's
            gradient under its own dropout mask, one batched forward's draws; ``pergrad_viz.core.randomness``).

    Returns:
        ``{name: Tensor (B, *param.shape)}`` in ``named_parameters()`` order, or (B, P) if ``flat``.

    Raises:
        ValueError: mismatched batch sizes, empty batch, unknown strategy, no trainable parameters, a bad ``out``;
            :class:`UnsupportedModelError` (a ValueError) for BatchNorm or Dropout in training mode or a layer the
            strategy cannot handle; :class:`MemoryBudgetError` before allocating a result over ``max_bytes``.
    """
    requested = strategy
    check_loss(loss_fn)  # None too: prepare takes None for a Jacobian
    targets = normal_tensor(targets) if isinstance(targets, torch.Tensor) else tree_map(normal_tensor, targets)
    trainable, strategy, inputs, chunk = prepare(model, inputs, targets, strategy, chunk_size, loss_fn, model_kwargs,
                                                  out, flat, randomness, verify)
    batch = inputs.size
    if out is not None:
        check_out(out, (batch, trainable.num_params), trainable, flat)
    race = _check_memory(trainable, strategy, batch, chunk, None, max_bytes, out)

    def run_chunk(chosen: Strategy, rows: slice, views: dict[str, torch.Tensor]) -> None:
        whole = rows.stop - rows.start == batch
        chosen.grads(trainable, loss_fn, inputs if whole else inputs.rows(rows),
                     targets if whole else cut(targets, rows, batch), views)

    def check(result: Result, used: str) -> None:
        check_grads(trainable, loss_fn, inputs, targets, _rows(result, trainable, 1), used,
                    batched=_apart(trainable, used), own_forward=REGISTRY[used].batched_forward)

    return hand_over(requested, strategy, trainable, inputs,
                     lambda s: _run(trainable, s, run_chunk, batch, chunk, None, flat, out), check if verify else None,
                     "grads", targets, race)


def output_size(trainable: Trainable, inputs: Batch) -> int:
    """Y, the number of output elements per sample, from a forward pass of the first sample (no grad)."""
    with torch.no_grad(), forked_random(trainable.device):  # a random forward is refused later, RNG untouched
        output = inputs.sample(0)(trainable.model)
    made = False  # whether output= computes with the model's parameters itself (of an output made without grad)
    if trainable.select is not None:
        with torch.enable_grad():
            raw, output = output, trainable.select(output)
            made = (isinstance(output, torch.Tensor) and output.requires_grad and not any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(raw)[0]) and any(
                g is not None for g in torch.autograd.grad(output.sum(), trainable.params, allow_unused=True)))
    check_differentiated(output, trainable.select is not None, made)
    return output.numel()


@computing_gradients
def per_sample_jacobian(model: nn.Module, inputs: Inputs, *, strategy: str = "auto", flat: bool = False,
                        chunk_size: int | None = None, max_bytes: int | None = None,
                        out: torch.Tensor | None = None, verify: bool = True, model_kwargs: Mapping | None = None,
                        output: Callable[[object], torch.Tensor] | None = None) -> Result:
    """Every output element of each sample with respect to every trainable parameter.

    Args are as in :func:`per_sample_grads` (no loss, no targets; B is the first dimension of the first input
    tensor); ``out`` is a (B, Y, P) buffer; ``output`` picks the tensor to differentiate from what the model
    returns, e.g. ``output=lambda out: out.logits`` for a Hugging Face model (default: the output itself).

    Returns:
        ``{name: Tensor (B, Y, *param.shape)}``, or (B, Y, P) if ``flat``; Y is the number of output
        elements per sample (an output (B, *out) is flattened).
    """
    requested = strategy
    trainable, strategy, inputs, chunk = prepare(model, inputs, None, strategy, chunk_size,
                                                  model_kwargs=model_kwargs, out=out, flat=flat, verify=verify,
                                                  offers_randomness=False, output=output)
    batch = inputs.size
    with restoring_modes(trainable):
        y_count = output_size(trainable, inputs)
    if out is not None:
        check_out(out, (batch, y_count, trainable.num_params), trainable, flat)
    race = _check_memory(trainable, strategy, batch, chunk, y_count, max_bytes, out)

    def run_chunk(chosen: Strategy, rows: slice, views: dict[str, torch.Tensor]) -> None:
        chosen.jacobian(trainable, inputs if rows.stop - rows.start == batch else inputs.rows(rows), views)

    def check(result: Result, used: str) -> None:
        check_jacobian(trainable, inputs, _rows(result, trainable, 2), used, batched=_apart(trainable, used),
                       own_forward=REGISTRY[used].batched_forward)

    def run(s: str) -> Result:
        return _run(trainable, s, run_chunk, batch, chunk, y_count, flat, out)

    if y_count == 0:
        return run("loop")  # nothing to differentiate: the empty (B, 0, ...) result, in every strategy

    return hand_over(requested, strategy, trainable, inputs, run, check if verify else None, "jacobian", may_race=race)
