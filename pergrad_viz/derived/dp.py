"""DP-SGD without the (B, P) per-sample gradients: the clipped (and noised) sum, and a training step that writes it
into ``.grad``.

Shapes: B samples, ``*shape`` a parameter's shape. The clipped sum of a batch is

    ``sum_i c_i g_i + N(0, (noise_multiplier * C)^2 I)``,  ``c_i = min(1, C / (||g_i|| + 1e-6))``

with g_i the per-sample gradient of :func:`pergrad_viz.per_sample_grads` (the gradient of sample i's loss alone).
With the ``hooks`` strategy (``"auto"`` picks it where the probe trusts it) it takes one hooked forward and one
backward pass (``pergrad_viz.derived.bookkeeping``); elsewhere the per-sample gradients are built one chunk at a
time and clipped (exact, slower).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from pergrad_viz import api
from pergrad_viz.core.batch import Inputs, first_tensor, normal_tensor
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.numbers import real_number, whole_number
from pergrad_viz.core.randomness import check_randomness
from pergrad_viz.core.trainable import Trainable, computing_gradients
from pergrad_viz.core.validate import check_flags, check_loss, check_strategy_name
from pergrad_viz.derived.bookkeeping import hooked_sums, materialised_sums
from pergrad_viz.derived.clipping import Groups, PerLayer, clipping_groups, noise_std
from pergrad_viz.derived.privacy import forget_noise, new_noise, warn_class_weights, warn_own_size
from pergrad_viz.derived.processes import agreed_count, all_reduce_sums, check_distributed, failing_together
from pergrad_viz.derived.sums import LazySums, initial_sums
from pergrad_viz.engine.certify import check_norms
from pergrad_viz.engine.combination import check_combination
from pergrad_viz.strategies import STRATEGIES


def check_dp_arguments(max_norm: object, noise_multiplier: object, generator: object, per_layer: object
                       ) -> tuple[float | None, float, PerLayer]:
    """(max_norm, noise_multiplier, per_layer) as numbers (any real scalar: a float, ``np.float32(0.5)``, a 0-dim
    tensor); ValueError / TypeError naming the fix for a bad bound, noise multiplier, generator or ``per_layer``."""
    if per_layer is not True and per_layer is not False and not isinstance(per_layer, Mapping):
        raise TypeError(f"per_layer must be True, False or a dict {{module prefix: bound}}, got {per_layer!r:.80}")
    if isinstance(per_layer, Mapping):
        if max_norm is not None:
            raise ValueError("with per_layer={prefix: bound, ...} the bounds are the dict's: pass max_norm=None")
        if not per_layer:
            raise ValueError("per_layer is an empty dict: give a bound per parameter group, e.g. {'': 1.0}")
        bounds = {}
        for key, bound in per_layer.items():
            if not isinstance(key, str):
                raise ValueError(f"per_layer's keys must be module prefixes (str, e.g. 'encoder.layer.0'), got {key!r}")
            bounds[key] = real_number(f"per_layer[{key!r}]", bound, positive=True,
                                      hint=" (the largest L2 norm that group of a sample's gradient may keep)")
        per_layer = bounds
    else:
        max_norm = real_number("max_norm", max_norm, positive=True,
                               hint=" (the largest L2 norm a sample's gradient may keep; None only with a "
                                    "per_layer={prefix: bound} dict)")
    noise_multiplier = real_number("noise_multiplier", noise_multiplier, hint=" (0 adds no noise)")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
    if generator is not None and (generator is torch.default_generator or generator in torch.cuda.default_generators):
        raise ValueError(
            "generator is torch's global generator, which dropout, data loading and torch.manual_seed share: the "
            "noise is drawn from a generator of its own. Create one once, before training, e.g. "
            "generator=torch.Generator().manual_seed(seed), and pass the same one at every step")
    if noise_multiplier > 0 and generator is None:
        raise ValueError(
            "noise_multiplier > 0 needs generator=: the noise is drawn from it alone (never from torch's global "
            "generator, which this call leaves as it was). Create one once, before training, e.g. "
            "generator=torch.Generator().manual_seed(seed), and pass the same one at every step (a fresh generator "
            "with the same seed at every step would repeat the noise)"
        )
    return max_norm, noise_multiplier, per_layer


@computing_gradients
def clipped_grad_sum(model: nn.Module, loss_fn: LossFn, inputs: Inputs, targets: object, max_norm: float | None, *,
                     noise_multiplier: float = 0.0, generator: torch.Generator | None = None,
                     per_layer: PerLayer = False, strategy: str = "auto", chunk_size: int | None = None,
                     verify: bool = True, model_kwargs: Mapping | None = None, return_norms: bool = False,
                     distributed: bool = False, randomness: str = "error"
                     ) -> dict[str, torch.Tensor] | tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The DP-SGD gradient of a batch: each sample's gradient clipped to ``max_norm``, summed, plus Gaussian noise.

    ``sum_i min(1, C / (||g_i|| + 1e-6)) g_i + N(0, (noise_multiplier * C)^2 I)`` with g_i the gradient of
    ``loss_fn(model(inputs[i:i+1]), targets[i:i+1])`` over the trainable parameters (what
    :func:`pergrad_viz.per_sample_grads` returns, inputs taken as it takes them), never forming the (B, P) matrix
    where the hooks strategy runs: one hooked forward, one backward, then per layer its ghost norm and its share of
    the sum from the same captures. A sum, not a mean: divide by the expected batch size for the step Opacus takes
    (:func:`dp_step` does).

    Args:
        model, loss_fn, inputs, targets, strategy, chunk_size, model_kwargs, verify: as
            :func:`pergrad_viz.per_sample_grad_norms` (``verify``: one random sample's norms checked against that
            sample alone).
        max_norm: C, a finite number > 0 (None with a ``per_layer`` dict).
        noise_multiplier: sigma >= 0; the noise std is sigma times the sensitivity (C; sqrt(sum_k C_k^2) per layer).
        generator: a ``torch.Generator`` on the parameters' device; required when ``noise_multiplier > 0`` (the noise
            is drawn from it alone, parameter by parameter in ``named_parameters()`` order).
        per_layer: False (one bound over all parameters), True (each parameter clipped alone to C / sqrt(K), K
            trainable parameters), or ``{module prefix: bound}`` (each parameter clipped with the group of its longest
            matching prefix, a parameter's name or a module path of it matched at dots: ``"enc"`` covers
            ``enc.0.weight``, not ``encoder.weight``; ``""`` matching all; then ``max_norm=None``).
        return_norms: also return the (B,) norms of the per-sample gradients before clipping.
        randomness: ``"error"`` (the default: a forward that draws random numbers is refused) or ``"different"``:
            dropout and drop-path left on, as DP fine-tuning runs, each sample's gradient that of its loss under its
            own mask (one batched forward's; the check draws the same masks again), as
            :func:`pergrad_viz.per_sample_grads`.
        distributed: under ``torch.distributed`` (torchrun; gloo or NCCL), each process passes its own samples: their
            clipped sums are all-reduced (one flat buffer), the noise is drawn once, on rank 0, from its ``generator``
            (every rank passes one; only rank 0's draws), so every rank returns the same sum as one process given
            all the samples. The norms returned are this process's.

    Returns:
        ``{name: Tensor (*param.shape)}`` per trainable parameter, in ``named_parameters()`` order (and the (B,)
        norms if ``return_norms``). ``.grad`` and the model are left as they were.

    Raises:
        ValueError / TypeError: a bound that is not a finite number > 0, a negative noise multiplier, noise without a
            generator, a generator on another device, a ``per_layer`` dict missing a parameter; as
            :func:`pergrad_viz.per_sample_grads` for the batch, strategy and model (all before any work).
    """
    check_distributed(distributed)
    with failing_together(distributed):  # the others told, not left to pair their next call with this one's
        max_norm, noise_multiplier, per_layer = check_dp_arguments(max_norm, noise_multiplier, generator, per_layer)
        check_flags(verify=verify, return_norms=return_norms)
        check_loss(loss_fn)
    if not distributed and _empty(inputs):
        raise ValueError("empty batch: clipped_grad_sum got no sample (Poisson sampling draws empty batches), and "
                         "the clipped sum of none is 0. For a DP step pv.dp_step takes it (the noise alone into .grad, "
                         "as pv.noise_step does); when adding up batches yourself, add only the noise for it")
    sums, norms, _ = _clipped(model, loss_fn, inputs, targets, max_norm, noise_multiplier, generator, per_layer,
                              strategy, chunk_size, verify, model_kwargs, distributed, randomness)
    return (sums, norms()) if return_norms else sums


def _clipped(model, loss_fn, inputs, targets, max_norm, noise_multiplier, generator, per_layer, strategy, chunk_size,
             verify, model_kwargs, distributed, randomness, agreed: tuple = ()
             ) -> tuple[dict[str, torch.Tensor], Callable[[], torch.Tensor], int]:
    """:func:`clipped_grad_sum`'s (sums, a call that gives the (B,) norms, the number of samples of every process
    together). Under ``distributed`` a process with no samples (Poisson sampling's empty batch) adds zeros (rank 0:
    the noise). ``distributed`` checked by the caller."""
    state = None if generator is None else generator.get_state()
    with new_noise(model, generator, noise_multiplier, distributed):
        with failing_together(distributed):
            sums, norms, count, (groups, std, shapes) = _local(model, loss_fn, inputs, targets, max_norm,
                                                               noise_multiplier, generator, per_layer, strategy,
                                                               chunk_size, verify, model_kwargs, distributed,
                                                               randomness)
        if distributed:
            count = _agreed(count, shapes, (tuple(groups), std, *agreed), generator, state)
            all_reduce_sums(sums)
    warn_class_weights(loss_fn, targets)
    return sums, norms, count


def _agreed(count: int, shapes: list[tuple], clipping: tuple, generator: torch.Generator | None,
            state: torch.Tensor | None) -> int:
    """:func:`agreed_count`; where the step failed somewhere, rank 0's generator put back where the step found it
    (its noise is drawn before: the step again draws the same noise, as one process's failed step draws none)."""
    try:
        return agreed_count(count, shapes, clipping)
    except Exception:
        if generator is not None:
            generator.set_state(state)
        raise


def _local(model, loss_fn, inputs, targets, max_norm, noise_multiplier, generator, per_layer, strategy, chunk_size,
           verify, model_kwargs, distributed, randomness) -> tuple:
    """This process's part of :func:`_clipped`: (sums, norms, B, (groups, noise std, shapes): what the processes
    check alike)."""
    targets = tree_map(normal_tensor, targets)
    nothing = distributed and _empty(inputs)  # nothing to clip here; the other processes' sums come in the all-reduce
    if nothing:
        _check_empty_call(strategy, randomness, targets)
        trainable = Trainable.of(model)
    else:
        trainable, resolved, batch, chunk = api.prepare(model, inputs, targets, strategy, chunk_size, loss_fn,
                                                        model_kwargs, randomness=randomness)
    groups, std, drawn, shapes = _noise_of(trainable, max_norm, noise_multiplier, generator, per_layer, distributed)
    state = None if generator is None else generator.get_state()

    def start() -> LazySums:  # the noise, drawn into the sums the clipped gradients are added to
        if generator is not None:
            generator.set_state(state)  # a hand-over to another route draws the same noise again
        return LazySums(shapes, drawn, generator)

    if nothing:
        sums, count = start(), 0

        def norms() -> torch.Tensor:
            return torch.zeros(0, dtype=trainable.dtype, device=trainable.device)
    else:
        sums, squared = _sums(trainable, resolved, strategy, loss_fn, batch, targets, chunk, chunk_size, verify,
                              groups, start)
        count = batch.size

        def norms() -> torch.Tensor:
            return torch.stack(list(squared.values())).sum(0).sqrt().to(trainable.dtype)  # float64 squares
    return sums.complete(), norms, count, (groups, std, shapes)


def _noise_of(trainable: Trainable, max_norm: float | None, noise_multiplier: float, generator: torch.Generator | None,
              per_layer: PerLayer, distributed: bool) -> tuple[Groups, float, float, list[tuple]]:
    """(clipping groups, the noise std, the std this process draws (under ``distributed`` rank 0 alone draws),
    [(name, shape, dtype, device)] of the trainable parameters); a generator on another device refused."""
    if generator is not None and generator.device.type != trainable.device.type:
        raise ValueError(f"generator is on {generator.device} but the parameters are on {trainable.device}; create it "
                         f"with torch.Generator(device={str(trainable.device)!r}).manual_seed(seed)")
    groups = clipping_groups(trainable.names, max_norm, per_layer)
    std = noise_std(noise_multiplier, groups)
    drawn = 0.0 if distributed and torch.distributed.get_rank() != 0 else std
    shapes = [(n, p.shape, p.dtype, p.device) for n, p in zip(trainable.names, trainable.params, strict=True)]
    return groups, std, drawn, shapes


def _sums(trainable: Trainable, resolved: str, strategy: str, loss_fn: LossFn, batch, targets: object, chunk: int,
          chunk_size: int | None, verify: bool, groups: Groups, start) -> tuple[dict, dict]:
    """({name: (*shape) clipped sum added to ``start()``}, {name: (B,) squared norms}): book-keeping where hooks
    runs, else (also where auto's hand-over moves on, ``api.hand_over``) the per-sample gradients in chunks."""

    def run(used: str) -> tuple[dict, dict]:
        if used == "hooks":  # the sums made after the backward
            return hooked_sums(trainable, loss_fn, batch, targets, chunk, groups, start)
        sums = start()
        return sums, materialised_sums(trainable, used, used, loss_fn, batch, targets, chunk_size, verify, groups,
                                       sums)

    def check(result: tuple[dict, dict], used: str) -> None:
        if used == "hooks":  # the other strategies' gradients were checked as they were computed
            check_combination(trainable, loss_fn, batch, targets, used, result[1])  # every row at once
            check_norms(trainable, loss_fn, batch, targets, result[1], used)  # one sample alone

    return api.hand_over(strategy, resolved, trainable, batch, run, check if verify else None, "clipped_sum", targets,
                         may_race=False)  # book-keeping never builds (B, P); torch_func would


@computing_gradients
def dp_step(model: nn.Module, loss_fn: LossFn, inputs: Inputs, targets: object, max_norm: float | None, *,
            noise_multiplier: float, generator: torch.Generator | None = None, expected_batch_size: int | None = None,
            **options) -> dict[str, torch.Tensor]:
    """Write the DP-SGD gradient into each trainable parameter's ``.grad``, for any ``torch.optim`` optimiser.

    ``.grad = clipped_grad_sum(...) / expected_batch_size`` (Opacus' convention: with Poisson sampling, divide by
    the expected batch size q * N, not by this batch's size, which is itself private); ``expected_batch_size=None``
    divides by this batch's B (with ``distributed=True``, the B of every process together). ``.grad`` is replaced,
    as after ``optimizer.zero_grad()`` and ``loss.backward()``: nothing is accumulated (a ``.grad`` tensor a parameter
    holds, a view of a flat gradient buffer, is written, as backward writes it; dense, also for a sparse
    Embedding's weight: the noise touches every row, so not for ``SparseAdam``). With :func:`noise_step`, the
    only calls of the package that write ``.grad``. An empty batch (B = 0, which Poisson sampling draws) is
    :func:`noise_step`'s (``expected_batch_size`` needed), so that every step the accountant counts is taken.

    Args:
        generator: the noise's ``torch.Generator``, required when ``noise_multiplier > 0`` (as
            :func:`clipped_grad_sum`).
        expected_batch_size: a positive int, or None (this batch's size).
        options: ``per_layer``, ``strategy``, ``chunk_size``, ``verify``, ``model_kwargs``, ``distributed``,
            ``randomness`` (``"different"`` for dropout on) as :func:`clipped_grad_sum`.

    Returns:
        ``{name: Tensor (*param.shape)}``, the tensors now in ``.grad``.
    """
    distributed = options.get("distributed", False)
    check_distributed(distributed, model)
    with failing_together(distributed):  # the others told, not left to pair their next call with this one's
        if expected_batch_size is not None:
            expected_batch_size = whole_number("expected_batch_size", expected_batch_size,
                                               hint=" (sampler.expected_batch_size) or None")
        unknown = set(options) - _OPTIONS
        if unknown:
            raise TypeError(f"dp_step() got unexpected keyword argument(s) {sorted(unknown)}; it takes "
                            f"{sorted(_OPTIONS)} as clipped_grad_sum does")
        check_flags(verify=options.get("verify", True))
        check_loss(loss_fn)
        if _empty(inputs) and not distributed:  # Poisson sampling's empty batch: noise alone
            if expected_batch_size is None:
                raise ValueError(_EMPTY)
            _check_empty_call(options.get("strategy", "auto"), options.get("randomness", "error"), targets)
            return noise_step(model, max_norm, noise_multiplier=noise_multiplier, generator=generator,
                              expected_batch_size=expected_batch_size, per_layer=options.get("per_layer", False))
        max_norm, noise_multiplier, per_layer = check_dp_arguments(max_norm, noise_multiplier, generator,
                                                                   options.pop("per_layer", False))
    state = None if generator is None else generator.get_state()
    sums, _, count = _clipped(model, loss_fn, inputs, targets, max_norm, noise_multiplier, generator, per_layer,
                              options.get("strategy", "auto"), options.get("chunk_size"), options.get("verify", True),
                              options.get("model_kwargs"), distributed, options.get("randomness", "error"),
                              (expected_batch_size,))  # every process divides by the same
    divisor = expected_batch_size
    if divisor is None:  # this batch's size (under distributed=True: over every process)
        if count == 0:  # every process's batch empty (the same count on every process: each raises)
            if generator is not None:  # as one process's refused step, which draws nothing
                generator.set_state(state)
                forget_noise(model, state)
            raise ValueError(_EMPTY.replace("empty batch", "empty batches on every process"))
        divisor = count
        if noise_multiplier > 0:
            warn_own_size()
    for total in sums.values():
        total.div_(divisor)
    return _into_grads(model, sums)


_OPTIONS = frozenset({"per_layer", "strategy", "chunk_size", "verify", "model_kwargs", "distributed", "randomness"})
_EMPTY = ("empty batch (B = 0, as Poisson sampling draws with probability (1 - q)^n): its DP step is noise alone, over "
          "the expected batch size; pass expected_batch_size=sampler.expected_batch_size (pv.PoissonBatches': "
          "max(1, round(sample_rate * len(dataset)))) at every step, or call pv.noise_step for it")


def _check_empty_call(strategy: str, randomness: str, targets: object) -> None:
    """An empty batch's options checked as a full batch's are (``api.prepare``), and its targets: ValueError where
    they hold samples (inputs and targets cut from different batches)."""
    check_strategy_name(strategy, STRATEGIES)
    check_randomness(randomness)
    held = [t for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0]]
    if held:
        raise ValueError(f"batch sizes differ: the inputs hold no sample but targets hold {held[0].shape[0]}; pass "
                         "the targets of the same samples (an empty batch: no targets either)")


def _empty(inputs: object) -> bool:
    """Whether the first tensor of ``inputs`` (which holds B first, as :class:`~pergrad_viz.core.batch.Batch`
    reads it) has no samples."""
    first = first_tensor(dict(inputs) if isinstance(inputs, Mapping) else inputs)  # a BatchEncoding as a dict
    return first is not None and first.dim() > 0 and first.shape[0] == 0


def noise_step(model: nn.Module, max_norm: float | None, *, noise_multiplier: float,
               generator: torch.Generator | None = None, expected_batch_size: int, per_layer: PerLayer = False,
               distributed: bool = False) -> dict[str, torch.Tensor]:
    """The DP step of an empty batch (Poisson sampling draws one with probability (1 - q)^n): ``.grad`` = noise of
    std ``noise_multiplier`` times the sensitivity (``max_norm``; with ``per_layer`` as :func:`clipped_grad_sum`)
    / ``expected_batch_size``, drawn from ``generator`` as :func:`dp_step` draws it, so that every step the
    accountant counts is taken (``distributed=True``: drawn on rank 0 alone and shared by an all-reduce, as
    :func:`dp_step` draws it). ``generator`` is required when ``noise_multiplier > 0``.

    Returns:
        ``{name: Tensor (*param.shape)}``, the tensors now in ``.grad``.
    """
    check_distributed(distributed)
    with failing_together(distributed):
        max_norm, noise_multiplier, per_layer = check_dp_arguments(max_norm, noise_multiplier, generator, per_layer)
        expected_batch_size = whole_number("expected_batch_size", expected_batch_size,
                                           hint=" (sampler.expected_batch_size: max(1, round(q * len(dataset))))")
        trainable = Trainable.of(model)
        groups, std, drawn, shapes = _noise_of(trainable, max_norm, noise_multiplier, generator, per_layer,
                                               distributed)
    state = None if generator is None else generator.get_state()
    with new_noise(model, generator, noise_multiplier, distributed):
        sums = initial_sums(shapes, drawn, generator)
        if distributed:
            _agreed(0, shapes, (tuple(groups), std, expected_batch_size), generator, state)
            all_reduce_sums(sums)
    for total in sums.values():
        total.div_(expected_batch_size)
    return _into_grads(model, sums)


def _into_grads(model: nn.Module, sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's ``.grad`` replaced by its sum: written into the dense ``.grad`` a parameter holds (a view of a
    flat gradient buffer, DDP's bucket views), as a backward after ``zero_grad(set_to_none=False)`` writes it, else
    the sum laid out as the parameter is (fused optimisers read ``.grad`` so: ``channels_last``); a sparse ``.grad``
    replaced. Returns the tensors now in ``.grad``."""
    params = dict(model.named_parameters())
    for name, total in sums.items():
        p, grad = params[name], params[name].grad
        if grad is not None and grad.layout == torch.strided and (grad.shape, grad.dtype, grad.device) == (
                total.shape, total.dtype, total.device):
            sums[name] = grad.copy_(total)
        elif total.stride() != p.stride() and p.shape == total.shape:
            p.grad = sums[name] = torch.empty_like(p, dtype=total.dtype).copy_(total)  # the parameter's strides
        else:
            p.grad = total
    return sums
