"""The public entry points: validate, estimate memory, guard the model, dispatch to a strategy.

Shapes: B samples, P trainable scalars (all parameters with ``requires_grad``, in
``named_parameters()`` order), Y output elements per sample (an output (B, *out) is flattened).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .certify import CheckFailedError, check_grads, check_jacobian
from .errors import UndefinedPerSampleError, UnsupportedModelError
from .losses import LossFn, check_loss
from .memory import check_budget, empty_result, result_bytes, working_bytes
from .probe import plan_for
from .strategies import MODULES, STRATEGIES, hooks, torch_func
from .trainable import Trainable, check_modes, computing_gradients, hooked_parameter, normal_tensor, restoring_modes

Result = dict[str, torch.Tensor] | torch.Tensor


def resolve_strategy(strategy: str, model: nn.Module | Trainable, inputs: torch.Tensor | None = None) -> str:
    """The strategy a call on ``model`` with ``inputs`` (B, ...) will use.

    ``auto`` is ``hooks`` (closed-form layer rules, and the per-layer fallback for layers without one) unless a
    probe of the model on two samples (cached per model and input signature, see ``pergrad_viz.probe``) finds
    that the samples interact, that a layer with trainable parameters does not keep the samples apart (e.g. a
    positional embedding broadcast over the batch), or that a parameter is used outside the forward of the
    layer that holds it: then ``torch_func``, which computes each sample alone. Without ``inputs`` nothing is
    probed and ``auto`` answers ``hooks``.

    Raises ValueError for an unknown name; :class:`UnsupportedModelError` when ``hooks``, ``autograd_stack`` or
    ``batched_grad`` (one batched forward pass) would not give the per-sample definition for these inputs.
    """
    _check_strategy_name(strategy)
    trainable = model if isinstance(model, Trainable) else Trainable.of(model)
    if inputs is not None:
        check_modes(trainable)  # before the probe runs the model
    hooked = hooked_parameter(trainable)
    if hooked is not None:
        if strategy == "auto":
            return "loop"
        if strategy != "loop":
            raise UnsupportedModelError(
                f"parameter '{hooked}' has a gradient hook (register_hook), which the per-sample definition (the loop "
                f"of torch.autograd.grad) applies but the {strategy} strategy cannot. Use strategy='loop' (or 'auto', "
                "which picks it), or remove the hook."
            )
    scripted = next((n for n, m in trainable.modules if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is not None and strategy != "loop":
        if strategy == "auto":
            return "loop"
        raise UnsupportedModelError(
            f"layer '{scripted or 'model'}' is a TorchScript module (torch.jit.script / trace): its calls cannot be "
            f"hooked nor run under torch.func, which the {strategy} strategy needs. Use strategy='loop' (or 'auto', "
            "which picks it), or pass the module as it was before scripting.")
    if strategy == "auto":
        try:
            hooks.check_supported(trainable, inputs)
            return "hooks"
        except UndefinedPerSampleError:
            raise
        except UnsupportedModelError:
            return "torch_func"
    if strategy == "hooks":
        hooks.check_supported(trainable, inputs)
    elif MODULES[strategy].BATCHED_FORWARD and inputs is not None:
        interaction = plan_for(trainable, inputs).interaction
        if interaction is not None:
            raise UnsupportedModelError(
                f"the {strategy} strategy runs the model once on the whole batch, but the samples interact: "
                f"{interaction}. Per-sample gradients are defined by each sample alone: use strategy='loop' or "
                "'torch_func' (or 'auto', which picks torch_func)."
            )
    return strategy


def _check_strategy_name(strategy: str) -> None:
    if strategy != "auto" and strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; valid names: 'auto', " + ", ".join(map(repr, STRATEGIES)))


def _check_inputs(trainable: Trainable, inputs: torch.Tensor, targets: torch.Tensor | None) -> None:
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"inputs must be a torch.Tensor of shape (B, ...), got {type(inputs).__name__}")
    if inputs.dim() == 0 or inputs.shape[0] == 0:
        raise ValueError(f"empty batch: inputs has shape {tuple(inputs.shape)}; pass at least one sample (B >= 1)")
    if targets is not None:
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a torch.Tensor of shape (B, ...), got {type(targets).__name__}")
        if targets.dim() == 0 or targets.shape[0] != inputs.shape[0]:
            got = "a scalar" if targets.dim() == 0 else f"{targets.shape[0]} samples"
            raise ValueError(
                f"batch sizes differ: inputs has {inputs.shape[0]} samples, targets has {got}; "
                "pass one target per input sample (same first dimension)"
            )
        if targets.device != inputs.device:
            raise ValueError(f"targets are on {targets.device} but inputs are on {inputs.device}; "
                             f"move them with targets.to({str(inputs.device)!r})")
    if inputs.device != trainable.device:
        raise ValueError(
            f"inputs are on {inputs.device} but the model's parameters are on {trainable.device}; "
            f"move one of them, e.g. inputs.to({str(trainable.device)!r}) or model.to({str(inputs.device)!r})"
        )
    if inputs.is_floating_point() and inputs.dtype != trainable.dtype:
        raise ValueError(
            f"inputs are {inputs.dtype} but the model's parameters are {trainable.dtype}; "
            f"cast one of them, e.g. inputs.to({trainable.dtype}) or model.to({inputs.dtype})"
        )


def _check_chunk(chunk_size: int | None, batch: int) -> int:
    if chunk_size is None:
        return batch
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int (samples per chunk) or None, got {chunk_size!r}")
    return min(chunk_size, batch)


def _check_out(out: torch.Tensor, shape: tuple[int, ...], trainable: Trainable, flat: bool) -> None:
    if not flat:
        raise ValueError("out= is a flat buffer: pass flat=True with it (or drop out= to get a dict)")
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    problems = []
    if tuple(out.shape) != shape:
        problems.append(f"shape {tuple(out.shape)} instead of {shape}")
    if out.dtype != trainable.dtype:
        problems.append(f"dtype {out.dtype} instead of {trainable.dtype}")
    if out.device != trainable.device:
        problems.append(f"device {out.device} instead of {trainable.device}")
    if problems:
        raise ValueError(
            "out= does not fit the result: " + "; ".join(problems) + ". Allocate it with "
            f"torch.empty({shape}, dtype={trainable.dtype}, device={str(trainable.device)!r})"
        )


def _run(trainable: Trainable, strategy: str, run_chunk: Callable, batch: int, chunk: int, outputs: int | None,
         flat: bool, out: torch.Tensor | None) -> Result:
    lead = (batch,) if outputs is None else (batch, outputs)
    kw = {"dtype": trainable.dtype, "device": trainable.device}
    with restoring_modes(trainable):  # also: the result is a normal tensor under the caller's inference_mode
        if flat:
            result = empty_result((*lead, trainable.num_params), **kw) if out is None else out
            views, offset = {}, 0
            for name, shape in trainable.shapes.items():
                n = shape.numel()
                views[name] = result[..., offset:offset + n].view(*lead, *shape)
                offset += n
        else:
            result = {name: empty_result((*lead, *shape), **kw) for name, shape in trainable.shapes.items()}
            views = result
        for start in range(0, batch, chunk):
            stop = min(start + chunk, batch)
            rows = views if chunk == batch else {n: v[start:stop] for n, v in views.items()}
            run_chunk(MODULES[strategy], slice(start, stop), rows)
    return result


def _prepare(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor | None, strategy: str,
             chunk_size: int | None, loss_fn: object = None) -> tuple[Trainable, str, int, int]:
    if loss_fn is not None:
        check_loss(loss_fn)
    _check_strategy_name(strategy)  # before anything is checked or run
    trainable = Trainable.of(model)
    _check_inputs(trainable, inputs, targets)
    chunk = _check_chunk(chunk_size, inputs.shape[0])
    return trainable, resolve_strategy(strategy, trainable, inputs), inputs.shape[0], chunk


def _run_auto(requested: str, resolved: str, trainable: Trainable, inputs: torch.Tensor,
              run: Callable[[str], Result], check: Callable[[Result, str], None] | None) -> Result:
    """Run ``resolved`` and, where it ran the model once on the whole batch, ``check`` its result (the per-call check,
    ``pergrad_viz.certify``; None: not asked for). Under ``auto``, a fast path that finds it cannot be trusted for this
    call hands over to one that computes each sample alone (``torch_func``, then the loop where ``vmap`` cannot), and
    a failed check is remembered in the plan (later calls go straight to ``torch_func``); any other error is the
    user's."""

    def checked(strategy: str) -> Result:
        result = run(strategy)
        if check is not None and MODULES[strategy].BATCHED_FORWARD:
            with restoring_modes(trainable):
                check(result, strategy)
        return result

    if requested != "auto":
        return checked(resolved)
    if resolved == "hooks":
        try:
            return checked("hooks")
        except CheckFailedError as e:
            plan_for(trainable, inputs).interaction = f"a per-call check failed ({str(e).split(' (')[0]})"
            resolved = "torch_func"
        except hooks.PlanMismatchError:
            resolved = "torch_func"
    if resolved == "torch_func":
        try:
            return run("torch_func")
        except torch_func.VmapError:
            return run("loop")  # torch.func cannot run this model (vmap or grad): the loop runs what PyTorch runs
    return run(resolved)


def _rows(result: Result, trainable: Trainable, lead: int) -> dict[str, torch.Tensor]:
    """{name: (B, [Y,] *param.shape)} views of a dict or flat result (``lead``: 1 for gradients, 2 for Jacobians)."""
    if isinstance(result, dict):
        return result
    views, offset = {}, 0
    for name, shape in trainable.shapes.items():
        views[name] = result[..., offset:offset + shape.numel()].view(*result.shape[:lead], *shape)
        offset += shape.numel()
    return views


@computing_gradients
def per_sample_grads(model: nn.Module, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor, *,
                     strategy: str = "auto", flat: bool = False, chunk_size: int | None = None,
                     max_bytes: int | None = None, out: torch.Tensor | None = None, verify: bool = True) -> Result:
    """The gradient of each sample's loss with respect to every trainable parameter.

    The per-sample gradient of sample i is the gradient of
    ``loss_fn(model(inputs[i:i+1]), targets[i:i+1])``: what the naive loop computes, whatever
    ``loss_fn``'s reduction.

    Args:
        model: any ``nn.Module``; left exactly as it was (no hooks, same parameters, ``.grad`` and modes).
        loss_fn: ``loss_fn(output, targets) -> scalar``, e.g. ``nn.CrossEntropyLoss()``.
        inputs: (B, ...) on the model's device (integer dtype for Embedding models).
        targets: (B, ...).
        strategy: ``"auto"`` or one of :data:`pergrad_viz.STRATEGIES`.
        flat: return one (B, P) tensor instead of a dict.
        chunk_size: process at most this many samples at a time, to bound working memory.
        max_bytes: memory budget (default: half of the memory available on the device).
        out: with ``flat=True``, a preallocated (B, P) tensor to write into (same dtype and device as
            the parameters); it is returned.
        verify: after a strategy that runs the model once on the whole batch, compare one randomly drawn sample's
            row with that sample computed alone (one small forward and backward; see ``pergrad_viz.certify``).
            ``False`` skips it: only for models you know keep their samples apart.

    Returns:
        ``{name: Tensor (B, *param.shape)}`` in ``named_parameters()`` order, or (B, P) if ``flat``.

    Raises:
        ValueError: mismatched batch sizes, empty batch, unknown strategy, no trainable parameters,
            a bad ``out``; :class:`UnsupportedModelError` (a ValueError) for BatchNorm or Dropout in
            training mode or a layer the strategy cannot handle; :class:`MemoryBudgetError` before
            allocating a result over ``max_bytes``.
    """
    requested = strategy
    inputs, targets = normal_tensor(inputs), normal_tensor(targets)
    trainable, strategy, batch, chunk = _prepare(model, inputs, targets, strategy, chunk_size, loss_fn)
    if out is not None:
        _check_out(out, (batch, trainable.num_params), trainable, flat)
    p = trainable.num_params
    check_budget(what=f"per-sample gradients of {batch} samples x {p:,} parameters",
                 result=result_bytes(batch, p, trainable.dtype),
                 working=working_bytes(strategy, chunk, batch, p, trainable.dtype,
                                       largest_param=trainable.largest_param),
                 max_bytes=max_bytes, allocate_result=out is None, device=trainable.device, batch=batch, chunk=chunk)

    def run_chunk(module, rows: slice, views: dict[str, torch.Tensor]) -> None:
        if rows.stop - rows.start == batch:
            module.grads(trainable, loss_fn, inputs, targets, views)
        else:
            module.grads(trainable, loss_fn, inputs[rows], targets[rows], views)

    def check(result: Result, used: str) -> None:
        check_grads(trainable, loss_fn, inputs, targets, _rows(result, trainable, 1), used)

    return _run_auto(requested, strategy, trainable, inputs,
                     lambda s: _run(trainable, s, run_chunk, batch, chunk, None, flat, out), check if verify else None)


def output_size(model: nn.Module, inputs: torch.Tensor) -> int:
    """Y, the number of output elements per sample, from a forward pass of the first sample (no grad)."""
    with torch.no_grad():
        output = model(inputs[:1])
    if not isinstance(output, torch.Tensor):
        raise TypeError(
            f"per_sample_jacobian differentiates the model's output tensor, but this model returns a "
            f"{type(output).__name__}: wrap it in a module that returns the one tensor you want, e.g. "
            "nn.Sequential(model, Select(0)) with a Select module returning output[0]"
        )
    return output.numel()


@computing_gradients
def per_sample_jacobian(model: nn.Module, inputs: torch.Tensor, *, strategy: str = "auto", flat: bool = False,
                        chunk_size: int | None = None, max_bytes: int | None = None,
                        out: torch.Tensor | None = None, verify: bool = True) -> Result:
    """Every output element of each sample with respect to every trainable parameter.

    Args are as in :func:`per_sample_grads` (no loss, no targets); ``out`` is a (B, Y, P) buffer.

    Returns:
        ``{name: Tensor (B, Y, *param.shape)}``, or (B, Y, P) if ``flat``; Y is the number of output
        elements per sample (an output (B, *out) is flattened).
    """
    requested = strategy
    inputs = normal_tensor(inputs)
    trainable, strategy, batch, chunk = _prepare(model, inputs, None, strategy, chunk_size)
    with restoring_modes(trainable):
        y_count = output_size(model, inputs)
    p = trainable.num_params
    if out is not None:
        _check_out(out, (batch, y_count, p), trainable, flat)
    check_budget(what=f"per-sample Jacobians of {batch} samples x {y_count} outputs x {p:,} parameters",
                 result=result_bytes(batch, p, trainable.dtype, y_count),
                 working=working_bytes(strategy, chunk, batch, p, trainable.dtype, y_count, trainable.largest_param),
                 max_bytes=max_bytes, allocate_result=out is None, device=trainable.device, batch=batch, chunk=chunk)

    def run_chunk(module, rows: slice, views: dict[str, torch.Tensor]) -> None:
        module.jacobian(trainable, inputs if rows.stop - rows.start == batch else inputs[rows], views)

    def check(result: Result, used: str) -> None:
        check_jacobian(trainable, inputs, _rows(result, trainable, 2), used)

    def run(s: str) -> Result:
        return _run(trainable, s, run_chunk, batch, chunk, y_count, flat, out)

    return _run_auto(requested, strategy, trainable, inputs, run, check if verify else None)
