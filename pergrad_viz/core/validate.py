"""Every check of a call, each refusal naming the fix: the model (:func:`check_model`, :func:`check_modes`), the loss
(:func:`check_loss`), the strategy's name, the inputs and targets (:func:`batch_of`), ``chunk_size`` and ``out=``.

Run before anything large is allocated and, for the model's modes, before the model runs (a forward pass in a mode
that mixes the samples would also change its buffers).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.ao.quantization.fake_quantize import FakeQuantizeBase
from torch.nn.utils import parametrize
from torch.utils._pytree import tree_flatten

from pergrad_viz.core.batch import Batch, Inputs, normal_tensor
from pergrad_viz.core.guards import REENTRANT_CHECKPOINT, check_parameter_kinds
from pergrad_viz.core.numbers import whole_number
from pergrad_viz.core.randomness import random_fix
from pergrad_viz.errors import UndefinedPerSampleError, UnsupportedModelError


class TrainableLike(Protocol):
    """What the checks read of a :class:`pergrad_viz.core.trainable.Trainable` (which stands on this module, so this
    module does not import it)."""

    modules: tuple[tuple[str, nn.Module], ...]
    model: nn.Module
    call: object  # its CallState

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

_DROPOUT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)
_RANDOM_IN_TRAINING = (*_DROPOUT, nn.RReLU)  # draw random numbers on every forward in training mode


def check_model(model: object, named_parameters: Sequence[tuple[str, nn.Parameter]] | None = None
                ) -> list[tuple[str, nn.Parameter]]:
    """The model's trainable parameters ``[(name, parameter)]`` in ``named_parameters()`` order, refusing what is not
    a module, a lazy parameter not initialised yet, and a model with nothing to differentiate. ``named_parameters``:
    ``model.named_parameters()`` when the caller has just walked it."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if named_parameters is None:
        named_parameters = tuple(model.named_parameters())
    named = [(n, p) for n, p in named_parameters if p.requires_grad]
    check_parameter_kinds(named)
    lazy = next((n for n, p in named if isinstance(p, nn.parameter.UninitializedParameter)), None)
    if lazy is not None:
        raise ValueError(
            f"parameter '{lazy}' is not initialised yet (a lazy module such as nn.LazyLinear): run one forward "
            "pass first, e.g. model(inputs[:1]), so that its shape is known"
        )
    if not named and isinstance(model, nn.modules.loss._Loss):
        raise TypeError(f"model is a loss ({type(model).__name__}): the arguments are (model, loss_fn, inputs, "
                        "targets), the model first")
    if not named:
        raise ValueError(
            "the model has no trainable parameters (none with requires_grad=True): there is nothing "
            "to differentiate; unfreeze some with p.requires_grad_(True)"
        )
    return named


_SPECIAL = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, nn.MultiheadAttention, nn.RNNBase,
            *_RANDOM_IN_TRAINING, nn.Embedding, nn.EmbeddingBag, FakeQuantizeBase)  # the types check_modes looks into
_SPECIAL_TYPES: dict[type, bool] = {}  # per module type: whether it is an instance of one of _SPECIAL (types do not
# change their bases, so this is read once per type)


def _special(kind: type) -> bool:
    special = _SPECIAL_TYPES.get(kind)
    if special is None:
        special = _SPECIAL_TYPES[kind] = issubclass(kind, _SPECIAL)
    return special


def check_modes(model: nn.Module | TrainableLike, randomness: str = "error") -> None:
    """Refuse layers whose per-sample gradients are undefined or random in the model's current mode.

    BatchNorm that uses batch statistics mixes the samples of a batch, so "the gradient of sample i"
    depends on the other samples; Dropout in training mode draws different masks in each strategy (allowed with
    ``randomness="different"``, ``pergrad_viz.core.randomness``). Read on every call, for every module (a flag
    changed since the last call must be seen); a module of another type costs a dict lookup, and its Hugging Face
    checkpointing flag is read in training mode only.
    """
    random_ok = randomness == "different"
    modules = tuple(model.named_modules()) if isinstance(model, nn.Module) else model.modules
    if parametrize._cache_enabled:  # inside parametrize.cached(): a weight computed once, on the first forward
        cached = next((name for name, m in modules if parametrize.is_parametrized(m)), None)
        if cached is not None:
            raise UndefinedPerSampleError(
                f"the call runs inside torch.nn.utils.parametrize.cached(), which computes the parametrized weights of "
                f"layer '{cached or 'model'}' once and keeps them: every sample's forward would reach them through "
                "that first pass's graph (freed after one backward; none at all where it ran under no_grad), so "
                "their per-sample gradients would be wrong. Call it outside the cached() block")
    for name, m in modules:
        if _special(type(m)):
            _check_special(name, m, random_ok, model)
        if m.training and _checkpointing(m):
            checkpointing = getattr(m, "_gradient_checkpointing_func", None)
            if getattr(checkpointing, "keywords", {}).get("use_reentrant") is True:
                raise UnsupportedModelError(f"{_label(name, m)}: {REENTRANT_CHECKPOINT}")


def _checkpointing(m: nn.Module) -> bool:
    """Whether ``m.gradient_checkpointing is True`` (Hugging Face's flag, an instance or class attribute), without the
    exception ``nn.Module.__getattr__`` raises for a module that has none."""
    if "gradient_checkpointing" in m.__dict__:
        return m.__dict__["gradient_checkpointing"] is True
    return hasattr(type(m), "gradient_checkpointing") and getattr(m, "gradient_checkpointing", False) is True


def _label(name: str, m: nn.Module) -> str:
    return f"layer '{name}' ({type(m).__name__})" if name else f"the model ({type(m).__name__})"


def _check_special(name: str, m: nn.Module, random_ok: bool, model: object) -> None:
    """check_modes for a module of one of the _SPECIAL types."""
    if isinstance(m, nn.modules.batchnorm._BatchNorm) and (m.training or not m.track_running_stats):
        fix = ("Call model.eval() to use the running statistics" if m.track_running_stats else
               "It has no running statistics (track_running_stats=False), so even in eval mode it uses the "
               "batch's: create it with track_running_stats=True and train it")
        raise UndefinedPerSampleError(
            f"{_label(name, m)} normalises with batch statistics, which mixes the samples of a batch, so "
            f"per-sample gradients are not defined. {fix}, or use GroupNorm / LayerNorm instead of BatchNorm."
        )
    if isinstance(m, nn.modules.instancenorm._InstanceNorm) and m.training and m.track_running_stats:
        raise UndefinedPerSampleError(
            f"{_label(name, m)} has track_running_stats=True in training mode: every forward pass would update its "
            "running statistics, so computing per-sample gradients would change your model. Call model.eval() "
            "or create it with track_running_stats=False."
        )
    internal_dropout = (isinstance(m, nn.MultiheadAttention) and m.dropout > 0) or (
        isinstance(m, nn.RNNBase) and m.dropout > 0 and m.num_layers > 1)
    if internal_dropout and m.training and not random_ok:
        raise UndefinedPerSampleError(
            f"{_label(name, m)} applies dropout={m.dropout} in training mode: it would draw different random masks in "
            "each strategy and each sample, so results would be random and not comparable. "
            f"{random_fix(model, 'create it with dropout=0', training=True)} (DP fine-tuning with dropout on)."
        )
    if isinstance(m, _RANDOM_IN_TRAINING) and m.training and getattr(m, "p", 1) > 0 and not random_ok:
        raise UndefinedPerSampleError(
            f"{_label(name, m)} is in training mode: it would draw different random numbers (masks, slopes) in each "
            "strategy and each sample, so results would be random and not comparable. "
            f"{random_fix(model, 'set p=0', training=True)}."
        )
    if isinstance(m, FakeQuantizeBase) and m.observer_enabled.any():
        raise UndefinedPerSampleError(  # a fused observer writes its statistics unseen by the version counters
            f"{_label(name, m)} observes its inputs (quantisation-aware training with its observer on, in eval mode "
            "too): every forward pass would update its statistics and scale, so computing per-sample gradients would "
            "change your model and each sample would see another quantisation. Turn the observers off for the call: "
            "model.apply(torch.ao.quantization.disable_observer) (model.apply(torch.ao.quantization.enable_observer) "
            "after it, to train on).")
    if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.max_norm is not None:
        raise UndefinedPerSampleError(
            f"{_label(name, m)} has max_norm={m.max_norm}, which rewrites its weight in place on every forward "
            "pass; per-sample gradients would change your model. Renormalise once yourself and "
            f"create the {type(m).__name__} with max_norm=None."
        )
    if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.scale_grad_by_freq:
        raise UndefinedPerSampleError(
            f"{_label(name, m)} has scale_grad_by_freq=True, which scales each token's gradient by its count in the "
            "batch its forward sees: a pass over the batch would count the other samples' tokens in each sample's "
            f"gradient, which the package does not undo. Create the {type(m).__name__} with scale_grad_by_freq=False "
            "(or scale the gradients yourself)."
        )


def check_loss(loss_fn: object) -> None:
    """Refuse what cannot give one scalar loss per sample: a loss class instead of an instance, None, and
    ``reduction='none'`` (one loss per element). The same rule for every strategy."""
    if isinstance(loss_fn, type):
        raise TypeError(f"loss_fn is the class {loss_fn.__name__}, not a loss: pass an instance, e.g. "
                        f"{loss_fn.__name__}() or {loss_fn.__name__}(reduction='sum')")
    if not callable(loss_fn):
        outputs = "; for the gradients of the model's outputs themselves: pv.per_sample_jacobian(model, inputs)"
        raise TypeError(f"loss_fn must be callable as loss_fn(output, targets) -> scalar, got {type(loss_fn).__name__}"
                        + (outputs if loss_fn is None else ""))
    if getattr(loss_fn, "reduction", None) == "none":
        raise ValueError(f"{type(loss_fn).__name__}(reduction='none') returns one loss per element, but a per-sample "
                         "gradient needs one scalar loss per sample: use reduction='sum' or reduction='mean' (the "
                         "per-sample gradient is the gradient of loss_fn(model(x[i:i+1]), y[i:i+1]))")


def check_strategy_name(strategy: str, valid: Sequence[str]) -> None:
    """Refuse a strategy name that is neither ``"auto"`` nor one of ``valid`` (:data:`pergrad_viz.STRATEGIES`)."""
    if strategy != "auto" and strategy not in valid:
        close = difflib.get_close_matches(str(strategy), ["auto", *valid], n=1)
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown strategy {strategy!r}{guess}; valid names: 'auto', " + ", ".join(map(repr, valid)))


def check_unlabelled_batch(batch: Batch) -> None:
    """With ``targets=None`` B is the first input tensor's first dimension: refuse where that tensor looks shared (a
    later one with more dimensions has another first dimension: ``model(scale (2,), x (5, 3))``), which would make
    B wrong and cut the wrong tensor."""
    named = [(n, t) for n, t in batch.named_leaves() if t.dim()]
    if not named:
        return
    first, t0 = named[0]
    other = next(((n, t) for n, t in named[1:] if t.dim() > t0.dim() and t.shape[0] != t0.shape[0]), None)
    if other is not None:
        raise ValueError(
            f"targets=None, so B is the first dimension of the first input tensor, {first!r} {tuple(t0.shape)}: B = "
            f"{t0.shape[0]}, and {other[0]!r} {tuple(other[1].shape)} would go whole to every sample. If the "
            f"samples are the rows of {other[0]!r}, put it first among the inputs (or pass targets, whose first "
            "dimension is B)")


def batch_of(trainable: TrainableLike, inputs: Inputs, targets: object = None, model_kwargs: Mapping | None = None
             ) -> Batch:
    """The call's :class:`~pergrad_viz.core.batch.Batch`, checked: B from the targets (or the first input tensor), every
    target tensor with B samples, some input tensor with B samples, every tensor on the parameters' device, floating
    inputs in the parameters' dtype."""
    size = None
    target_tensors = [targets] if isinstance(targets, torch.Tensor) else (
        [] if targets is None else [t for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor)])
    if targets is not None:
        if not target_tensors:
            raise TypeError(f"targets must be a torch.Tensor of shape (B, ...) or a tuple / dict of them, got "
                            f"{type(targets).__name__}")
        per_sample = [t for t in target_tensors if t.dim()]  # a 0-dim one beside them is shared, passed whole
        if not per_sample:
            raise ValueError("batch sizes differ: targets has a scalar; pass one target per input sample (B, ...)")
        size = per_sample[0].shape[0]
        sizes = {int(t.shape[0]) for t in per_sample}
        if len(sizes) > 1:
            raise ValueError(f"the target tensors hold different numbers of samples {sorted(sizes)}: pass one target "
                             "per sample in each (same first dimension)")
    batch = inputs if isinstance(inputs, Batch) else Batch.of(inputs, model_kwargs, size).map(normal_tensor)
    tensors = batch.named_leaves()
    if targets is not None and not batch.leaves():
        if len(tensors) == 1 and tensors[0][1].dim():
            one = " (one sample without its batch dimension? pass x[i:i+1] or x.unsqueeze(0))" if size == 1 else ""
            raise ValueError(
                f"batch sizes differ: inputs has {tensors[0][1].shape[0]} samples, targets has {size} samples{one}; "
                "pass one target per input sample (same first dimension)")
        firsts = ", ".join(f"{name} {tuple(t.shape)}" for name, t in tensors)
        listed = type(inputs) in (list, tuple) and len(inputs) == size == len(tensors)  # one tensor a sample?
        stack = "; the inputs are a list of one tensor per sample? Stack them: torch.stack(inputs)" if listed else ""
        raise ValueError(
            f"batch sizes differ: targets hold {size} samples but no input tensor has {size} as its first dimension "
            f"({firsts}); pass one target per input sample (same first dimension){stack}")
    device = trainable.device
    on = {"inputs": tensors[0][1].device, "targets": target_tensors[0].device} if tensors and target_tensors else {}
    if on and on["inputs"] != on["targets"] and device in on.values():  # the one not on the model's device is named
        odd = "targets" if on["inputs"] == device else "inputs"
        other = "inputs" if odd == "targets" else "targets and the model's parameters"
        raise ValueError(f"{odd} are on {on[odd]} but {other} are on {device}; move them with "
                         f"{tensors[0][0] if odd == 'inputs' else odd}.to({str(device)!r})")  # inputs[0].to(...)
    for name, t in tensors + [("targets", t) for t in target_tensors]:
        if t.device != device:
            are = "are" if name in ("inputs", "targets") else "is"
            raise ValueError(
                f"{name} {are} on {t.device} but the model's parameters are on {device}; move one of them, e.g. "
                f"{name}.to({str(device)!r}) or model.to({str(t.device)!r})"
            )
    for name, t in tensors:
        if t.is_floating_point() and t.dtype != trainable.dtype and t.dim() and t.shape[0] == batch.size:
            are = "are" if name == "inputs" else "is"
            raise ValueError(
                f"{name} {are} {t.dtype} but the model's parameters are {trainable.dtype}; "
                f"cast one of them, e.g. {name}.to({trainable.dtype}) or model.to({t.dtype})"
            )
    return batch


def check_inputs_kept(trainable: TrainableLike) -> None:
    """Refuse a forward that wrote one of the call's input tensors in place (``x.add_(1)`` on its argument): the
    package runs the model on them more than once (a sample alone, the check), and each run would see other
    values; ``trainable.call.input_versions`` holds the versions the call found (``Batch.versions``)."""
    refuse_written_inputs(trainable.call.input_versions)


def refuse_written_inputs(versions: Sequence[tuple[str, torch.Tensor, int]], copies: bool = False) -> None:
    """:func:`check_inputs_kept` of ``versions`` (``Batch.versions()`` before the model ran on them; ``copies``:
    of copies the package made, the caller's tensors untouched)."""
    for name, t, version in versions:
        if t._version != version:
            kept = "your tensor is as it was: the model ran on a copy" if copies else "your tensor was changed"
            raise UndefinedPerSampleError(
                f"the forward pass writes its input {name!r} in place (x.add_(...), x[...] = ... on its argument; "
                f"{kept}), so running the model on it again (each sample alone, the check) would see other "
                "values. Write it out of place in forward (x = x + 1, x = x.clone() first; an in-place activation "
                "as the first layer, nn.ReLU(inplace=True): inplace=False).")


def check_flags(**flags: object) -> None:
    """TypeError naming the first of ``flags`` (``verify=True``, ``flat=...``) that is not a bool (``"yes"`` is
    truthy, ``"no"`` too)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def check_chunk(chunk_size: int | None, batch: int) -> int:
    """The samples per chunk: ``chunk_size`` (a positive int) capped at B, or B for None."""
    if chunk_size is None:
        return batch
    return min(whole_number("chunk_size", chunk_size, hint=" (samples per chunk) or None"), batch)


def check_out(out: torch.Tensor, shape: tuple[int, ...], trainable: TrainableLike, flat: bool) -> None:
    """Refuse an ``out=`` buffer that is not a flat tensor of ``shape`` ((B, P) or (B, Y, P)) in the parameters'
    dtype and device, or that comes without ``flat=True``."""
    check_out_memory(out, trainable, flat)
    problems = []
    if tuple(out.shape) != shape:
        problems.append(f"shape {tuple(out.shape)} instead of {shape}")
    if out.dtype != trainable.dtype:
        problems.append(f"dtype {out.dtype} instead of {trainable.dtype}")
    if out.device != trainable.device:
        problems.append(f"device {out.device} instead of {trainable.device}")
    if problems:
        raise ValueError("out= does not fit the result: " + "; ".join(problems) + ". Allocate it with "
                         + _fresh(shape, trainable))


def _fresh(shape: tuple[int, ...] | None, trainable: TrainableLike, outputs: bool = False) -> str:
    dims = ("(B, Y, P)" if outputs else "(B, P)") if shape is None else shape
    return f"torch.empty({dims}, dtype={trainable.dtype}, device={str(trainable.device)!r})"


def check_out_memory(out: torch.Tensor, trainable: TrainableLike, flat: bool, inputs: Batch | None = None,
                     targets: object = None, loss_fn: object = None) -> None:
    """Refuse an ``out=`` buffer that cannot hold distinct results, before anything runs: a tensor that records
    gradients, an inference tensor, one whose elements share memory (``torch.empty(P).expand(B, P)``: every row the
    same memory), or one that overlaps the memory the call reads or leaves as it was (the inputs, the targets, the
    model's parameters, buffers and ``.grad``, a loss module's tensors (``CrossEntropyLoss(weight=...)``): the results
    would overwrite them)."""
    if not flat:
        raise ValueError("out= is a flat buffer: pass flat=True with it (or drop out= to get a dict)")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    fresh = _fresh(None, trainable, outputs=out.dim() == 3)  # a Jacobian's buffer
    if out.layout != torch.strided:
        raise ValueError(f"out= is a {out.layout} tensor; the results are written into a dense one: {fresh}")
    if out.requires_grad:
        raise ValueError(
            "out= requires grad (a leaf with requires_grad=True, or a result of an autograd graph): the results are "
            f"written into it in place, which autograd forbids. Pass a plain buffer, e.g. {fresh} (or out.detach())")
    if out.is_inference():
        raise ValueError(
            "out= is an inference tensor (allocated under torch.inference_mode()), which cannot be written outside "
            f"it. Allocate it outside inference_mode, e.g. {fresh}")
    if out.numel() and _overlaps_itself(out):
        raise ValueError(
            f"out= has strides {tuple(out.stride())}: its elements share memory (e.g. an expand()ed tensor, where "
            f"every row is the same memory), so its rows cannot hold distinct results. Allocate it with {fresh}")
    read = list(trainable.model.named_parameters()) + list(trainable.model.named_buffers())
    read += [(f"{name}.grad", p.grad) for name, p in trainable.model.named_parameters() if p.grad is not None]
    if inputs is not None:
        read += inputs.named_leaves()
    if targets is not None:
        read += [("targets", t) for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor)]
    if isinstance(loss_fn, nn.Module):
        read += [(f"loss_fn.{name}", t) for name, t in (*loss_fn.named_parameters(), *loss_fn.named_buffers())]
        read += [(f"loss_fn.{name}", t) for name, t in vars(loss_fn).items() if isinstance(t, torch.Tensor)]
    hit = next((name for name, t in read if out.numel() and t.numel() and _share_memory(out, t)), None)
    if hit is not None:
        raise ValueError(
            f"out= overlaps the memory of {hit}, which the call reads while it writes the results or leaves as it "
            f"was: the results would overwrite it. Pass a buffer of its own, e.g. {fresh}")


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: its dimensions, from the smallest stride up, must each step
    past everything the smaller ones span (a zero stride on a dimension of size > 1 never does)."""
    span = 1
    dims = sorted(((abs(st), s) for s, st in zip(t.shape, t.stride(), strict=True) if s > 1))
    for stride, size in dims:
        if stride < span:
            return True
        span = stride * (size - 1) + span
    return False


def _memory_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, stop)`` that ``t``'s elements lie in."""
    low = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if st < 0)
    high = sum((s - 1) * st for s, st in zip(t.shape, t.stride(), strict=True) if st > 0)
    start = t.data_ptr() + low * t.element_size()
    return start, t.data_ptr() + (high + 1) * t.element_size()


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (on one storage) have bytes in common (conservatively: their ranges overlap)."""
    if a.device != b.device or b.layout != torch.strided:
        return False
    (a0, a1), (b0, b1) = _memory_range(a), _memory_range(b)
    return a0 < b1 and b0 < a1
