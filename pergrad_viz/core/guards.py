"""Checks of what a call finds while it runs, each refusal naming the fix: no trainable parameter reached by the
forward (a peft model after ``merge_adapter()``), gradient checkpointing with ``use_reentrant=True`` (which refuses
``torch.autograd.grad``), a call under ``torch.autocast``."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from pergrad_viz.core.graph import walk
from pergrad_viz.errors import HandOverError, UndefinedPerSampleError, UnsupportedModelError


class Trainable(Protocol):
    """What these checks read of a :class:`pergrad_viz.core.trainable.Trainable` (which stands on this module through
    ``core.validate``, so this module does not import it)."""

    names: tuple[str, ...]
    params: tuple[torch.nn.Parameter, ...]
    modules: tuple[tuple[str, torch.nn.Module], ...]

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

REENTRANT_CHECKPOINT = (
    "the model uses gradient checkpointing with use_reentrant=True, whose recomputation runs only inside .backward(): "
    "PyTorch refuses torch.autograd.grad and torch.func through it, which every strategy (the loop included) needs. "
    "Use use_reentrant=False (the default PyTorch recommends): torch.utils.checkpoint.checkpoint(fn, *args, "
    "use_reentrant=False), or for a Hugging Face model model.gradient_checkpointing_enable("
    "gradient_checkpointing_kwargs={'use_reentrant': False}); or turn it off (model.gradient_checkpointing_disable())")

# A forward that reuses a tensor computed from a parameter in an earlier pass: the fix, in the probe's refusal
# (engine/observe.py) and in the note on autograd's own error where that is what the user sees (core/users.py).
KEPT_TENSOR_FIX = (
    "Make the forward compute such a tensor from the parameters every time (for timm's LeViT and EfficientViT, "
    "which keep attention_bias_cache in eval mode: type(m).get_attention_biases = lambda self, device: "
    "self.attention_biases[:, self.attention_bias_idxs] for each module m that has it)")


def check_takes_part(trainable: Trainable, result: torch.Tensor, what: str = "loss") -> None:
    """Refuse a call in which no trainable parameter takes part: ``result`` (the loss, or the model output of a
    Jacobian) does not depend on any of them, so every per-sample gradient would be zero (where some take part,
    those that do not get zeros, as the loop's ``allow_unused`` gives)."""
    if isinstance(result, torch.Tensor) and not result.requires_grad:
        raise nothing_takes_part(trainable, what)


def check_reached(trainable: Trainable, calls: Sequence, what: str = "loss") -> None:
    """Refuse a hooked forward (``calls``: the captured layer calls, ``pergrad_viz.engine.capture``) in which no
    layer output carries a gradient: no trainable parameter takes part (as :func:`check_takes_part`); or in which
    a layer ran without gradients inside a reentrant checkpoint (:func:`check_no_reentrant_checkpoint`)."""
    carried = [any(t.requires_grad for t in (*c.outputs, *c.internals)) for c in calls]
    if not any(carried):
        raise nothing_takes_part(trainable, what)
    check_computed_in(trainable, calls)
    if not all(carried):  # a layer ran under no_grad: the user's own, or a reentrant checkpoint's forward
        check_no_reentrant_checkpoint([t for c in calls for t in c.tensors()])


def check_computed_in(trainable: Trainable, calls: Sequence) -> None:
    """Hand over (:class:`HandOverError`) where a layer's output is in another floating dtype than the parameters'
    (``torch.autocast`` inside the forward, or layers of several dtypes): the layer rules would mix the two."""
    for c in calls:
        for t in c.outputs:
            if t.is_floating_point() and t.dtype != trainable.dtype:
                raise HandOverError(
                    f"a layer computed in {t.dtype} while the parameters are {trainable.dtype} (torch.autocast inside "
                    f"the forward, or layers of several dtypes): the layer rules would mix the two. Use "
                    f"strategy='auto' or 'loop' (each sample alone, as the forward runs it)",
                    reason=f"a layer computed in {t.dtype}, the parameters {trainable.dtype}")


def reentrant_checkpoint_in(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether the backward graph of any of ``tensors`` holds a checkpoint with ``use_reentrant=True``: its layers
    ran under no_grad and are recomputed only by ``.backward()``, so ``autograd.grad`` (every strategy, the loop's
    too) would see no gradient for them where one samples' ``.backward()`` finds it. One walk, each node once."""
    roots = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor)]
    return any(node.name() == "CheckpointFunctionBackward" for node in walk(roots))


def in_reentrant_checkpoint() -> bool:
    """Whether the code running now is inside a reentrant checkpoint's forward (``use_reentrant=True``: its layers run
    under no_grad and are recomputed only by ``.backward()``; where no input of the checkpoint requires grad it leaves
    no trace in the graph, and PyTorch gives those layers no gradient at all). A walk up the stack, where gradients
    are off only."""
    if torch.is_grad_enabled():
        return False
    from torch.utils.checkpoint import CheckpointFunction

    code = CheckpointFunction.forward.__code__
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def noting_reentrant_layers() -> Iterator[list[nn.Module]]:
    """Inside: the modules that run inside a reentrant checkpoint's forward (:func:`in_reentrant_checkpoint`) are
    listed in the list yielded (a global forward pre-hook, removed on exit)."""
    found: list[nn.Module] = []

    def note(module: nn.Module, args: tuple) -> None:
        if in_reentrant_checkpoint():
            found.append(module)

    handle = nn.modules.module.register_module_forward_pre_hook(note)
    try:
        yield found
    finally:
        handle.remove()


def check_no_reentrant_checkpoint(tensors: Sequence[torch.Tensor]) -> None:
    """Raise :class:`UnsupportedModelError` naming ``use_reentrant=False`` where :func:`reentrant_checkpoint_in`."""
    if reentrant_checkpoint_in(tensors):
        raise UnsupportedModelError(REENTRANT_CHECKPOINT)


def nothing_takes_part(trainable: Trainable, what: str = "loss") -> ValueError:
    """The error of a call in which no trainable parameter takes part in ``what`` (see :func:`check_takes_part`)."""
    names = list(trainable.names)
    shown = ", ".join(f"'{n}'" for n in names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return ValueError(
        f"no trainable parameter takes part in the {what}: {shown} (requires_grad=True) are not used by the forward "
        "pass on these inputs, so every per-sample gradient would be zero. Typical causes: a peft model after "
        "merge_adapter() (the adapters are merged into the frozen weights and no longer run: call "
        "model.unmerge_adapter() first), a forward that runs those layers under torch.no_grad() or detaches their "
        "outputs, a loss_fn that detaches its result or returns a constant, or the wrong parameters unfrozen (set "
        "requires_grad_(True) on those the forward uses)")


def _from_reentrant_checkpoint(error: BaseException) -> bool:
    """Whether ``error`` (or its cause) is PyTorch refusing autograd.grad / torch.func through a reentrant checkpoint:
    its message says so, or an autograd.Function without setup_context was applied from torch/utils/checkpoint.py."""
    for e in (error, error.__cause__):
        if e is None:
            continue
        msg = str(e)
        if "use_reentrant=True" in msg and "checkpoint" in msg:
            return True
        frames = traceback.extract_tb(e.__traceback__)
        if "autograd.Function" in msg and any(f.filename.endswith(os.path.join("utils", "checkpoint.py"))
                                              for f in frames):
            return True
    return False


@contextlib.contextmanager
def refusing_reentrant_checkpoints() -> Iterator[None]:
    """Turn PyTorch's error for a reentrant checkpoint (``use_reentrant=True``) into an
    :class:`UnsupportedModelError` naming ``use_reentrant=False``; any other error passes unchanged."""
    try:
        yield
    except (RuntimeError, ValueError) as e:
        if isinstance(e, UnsupportedModelError) and str(e) == REENTRANT_CHECKPOINT:
            raise  # found in the graph (check_no_reentrant_checkpoint): already this refusal
        if not isinstance(e, UndefinedPerSampleError) and _from_reentrant_checkpoint(e):
            # torch.func's own error type is kept (auto hands it over to the loop, which then says it)
            kind = type(e) if isinstance(e, UnsupportedModelError) else UnsupportedModelError
            raise kind(REENTRANT_CHECKPOINT) from e
        raise


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes in on ``device``'s type now, or None outside autocast."""
    if not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def check_autocast(strategy: str, trainable: Trainable) -> bool:
    """Whether the call runs under ``torch.autocast`` for the parameters' device (then ``auto`` is the loop: each
    sample alone under autocast, the very computation of the definition, the result in the parameters' dtype); any
    other strategy than the loop is refused, naming it: the batched ones agree with the loop only to the autocast
    dtype's precision, and the layer rules and torch.func mix the autocast dtype with the parameters'."""
    dtype = autocast_dtype(trainable.device)
    if dtype is None:
        return False
    if strategy not in ("auto", "loop"):
        raise UnsupportedModelError(
            f"the call runs under torch.autocast({trainable.device.type!r}, dtype={dtype}), which the {strategy} "
            f"strategy cannot follow (its batched forward, layer rules or torch.func mix {dtype} with the "
            f"parameters' {trainable.dtype}). Use strategy='auto' or 'loop' (each sample alone under autocast, the "
            f"result in {trainable.dtype}), or call it outside the autocast block")
    return True


def check_one_dtype(strategy: str, trainable: Trainable) -> bool:
    """Whether the trainable parameters are of several floating dtypes (a float32 layer beside a float64 one; then
    ``auto`` is the loop: each sample alone, as the forward casts between them); any other strategy than the loop
    is refused, naming it: the layer rules, the flat layout and torch.func compute in one dtype."""
    dtypes = {}
    for name, p in zip(trainable.names, trainable.params, strict=True):
        dtypes.setdefault(p.dtype, name)
    if len(dtypes) < 2:
        return False
    if strategy not in ("auto", "loop"):
        listed = ", ".join(f"{dtype} ('{name}')" for dtype, name in dtypes.items())
        raise UnsupportedModelError(
            f"the trainable parameters are of several dtypes ({listed}), which the {strategy} strategy cannot mix "
            f"(its layer rules and torch.func compute in one dtype). Use strategy='auto' or 'loop' (each sample "
            f"alone, as the forward casts), or cast the model to one dtype (model.float() or model.double())")
    return True


def special_model_strategy(trainable: Trainable, strategy: str) -> str | None:
    """The strategy for a call under autocast, parameters of several dtypes, a model with a gradient hook on a
    parameter, a compiled or a TorchScript layer (None: none of these); raises :class:`UnsupportedModelError` where
    ``strategy`` cannot run it."""
    if check_autocast(strategy, trainable) or check_one_dtype(strategy, trainable):  # as the calls do, before a probe
        return "loop"  # (under autocast resolve_strategy's probe blamed a tensor kept from an earlier pass; a review)
    disabled = getattr(torch._C._autograd, "_saved_tensors_hooks_get_disabled_error_message", lambda: None)()
    if disabled is not None and strategy != "loop":  # the probe and the capture note what the forward saves
        if strategy == "auto":
            return "loop"
        raise UnsupportedModelError(
            f"the call runs inside torch.autograd.graph.disable_saved_tensors_hooks(...) ({disabled!r}), and the "
            f"{strategy} strategy registers saved-tensor hooks to see what the forward saves. Use strategy='auto' "
            "(which picks the loop here) or 'loop', or make the call outside that block")
    subclass = next((n for n, p in zip(trainable.names, trainable.params, strict=True) if _own_torch_function(p)),
                    None)
    if subclass is not None and strategy in ("hooks", "torch_func"):
        raise UnsupportedModelError(
            f"parameter '{subclass}' is a tensor subclass with its own __torch_function__, which may change what a "
            f"layer computes with it: the {strategy} strategy (its layer rules / functional_call's plain tensors) "
            "would not see that. Use strategy='auto' (which picks the loop here), 'loop', 'autograd_stack' or "
            "'batched_grad'")
    if subclass is not None and strategy == "auto":
        return "loop"
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
    compiled = next((n for n, m in trainable.modules if type(m).__name__ == "OptimizedModule"), None)
    if compiled is not None and strategy in ("hooks", "autograd_stack", "batched_grad"):
        raise UnsupportedModelError(
            f"layer '{compiled or 'model'}' is compiled (torch.compile): the {strategy} strategy cannot see inside it. "
            f"Pass the module it wraps (model._orig_mod: the same parameters) to use {strategy}, or use "
            "strategy='auto' (which picks torch_func here), 'torch_func' or 'loop'.")
    if compiled is not None and strategy == "auto":
        return "torch_func"
    scripted = next((n for n, m in trainable.modules if isinstance(m, torch.jit.ScriptModule)), None)
    if scripted is not None and strategy != "loop":
        if strategy == "auto":
            return "loop"
        raise UnsupportedModelError(
            f"layer '{scripted or 'model'}' is a TorchScript module (torch.jit.script / trace): its calls cannot be "
            f"hooked nor run under torch.func, which the {strategy} strategy needs. Use strategy='loop' (or 'auto', "
            "which picks it), or pass the module as it was before scripting.")
    return None


def hooked_parameter(trainable: Trainable) -> str | None:
    """The name of a trainable parameter with a gradient hook (``p.register_hook``), if any: ``torch.autograd.grad``
    (the loop) applies such hooks; the batched strategies compute the plain gradient and cannot."""
    return next((n for n, p in zip(trainable.names, trainable.params, strict=True) if p._backward_hooks), None)


def check_apart_from_parameters(trainable: Trainable, named: Sequence[tuple[str, torch.Tensor]],
                                targets: object = None) -> None:
    """Refuse an input (``named``: [(name, tensor)]) or a tensor of ``targets`` that is a trainable parameter or was
    computed from one without ``.detach()`` (``x = model.fc1.weight[:6]``): the loop's backward would reach the
    parameter through the inputs too, the batched strategies would not, so the rows would depend on the strategy.
    Walks the graphs of such tensors alone (those that require grad)."""
    owned = {id(p): n for n, p in zip(trainable.names, trainable.params, strict=True)}
    aimed = [("targets", t) for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor)]
    for name, t in [*named, *aimed]:
        if not t.requires_grad:
            continue
        found = owned.get(id(t)) if t.grad_fn is None else next(
            (owned[id(v)] for node in walk([t.grad_fn]) if id(v := getattr(node, "variable", None)) in owned), None)
        if found is not None:
            raise ValueError(
                f"{name} {'is' if t.grad_fn is None else 'was computed from'} the model's trainable parameter "
                f"'{found}': a sample's loss (or output) would reach that parameter through its input as well as "
                f"through the model, which the per-sample definition leaves open. Pass {name.split('[')[0]}.detach() "
                "(the input as a constant), or compute it inside the model's forward")


def check_parameter_kinds(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Refuse trainable parameters ``[(name, parameter)]`` that hold no values (the meta device), inference tensors, or
    complex numbers (the rules, norms and clip factors are written for real ones: ``hooks`` gave rows 2.7 off). A
    frozen inference tensor is fine where the backward does not pass through it (``core.users`` names it where it
    does)."""
    meta = next((n for n, p in named if p.is_meta), None)
    if meta is not None:
        raise ValueError(
            f"parameter '{meta}' is on the meta device: it has a shape but no values (a model built under "
            "torch.device('meta') or an empty-weights context), so there is nothing to differentiate. Give it values "
            "first, e.g. model.to_empty(device='cpu') then model.load_state_dict(state_dict)")
    inference = next((n for n, p in named
                      if not isinstance(p, torch.nn.parameter.UninitializedTensorMixin) and p.is_inference()), None)
    if inference is not None:
        raise ValueError(
            f"parameter '{inference}' was created under torch.inference_mode(): autograd cannot save it for a "
            "backward, so nothing can be differentiated. Build or load the model outside inference_mode "
            "(torch.no_grad() is fine there)")
    complex_ = next(((n, p.dtype) for n, p in named if p.is_complex()), None)
    if complex_ is not None:
        raise TypeError(
            f"parameter '{complex_[0]}' is complex ({complex_[1]}): per-sample gradients are computed for real "
            "parameters only. Keep it as a real parameter of shape (..., 2) and use torch.view_as_complex(...) inside "
            "the forward, so that its gradient is real")


_PLAIN_TORCH_FUNCTIONS = (torch.Tensor.__torch_function__.__func__, torch._C._disabled_torch_function_impl)


def _own_torch_function(p: torch.Tensor) -> bool:
    """Whether a parameter's class overrides ``__torch_function__`` (``nn.Parameter`` and ``torch.Tensor`` do not)."""
    function = type(p).__torch_function__
    return getattr(function, "__func__", function) not in _PLAIN_TORCH_FUNCTIONS


def check_output_count(what: str, count: int, wanted: int, against: str = "sample 0 alone") -> None:
    """Refuse ``what`` (``"sample 3 alone"``) giving ``count`` output elements a sample where ``against`` gives
    ``wanted`` (Y): the per-sample Jacobians would be ragged."""
    if count != wanted:
        raise UndefinedPerSampleError(
            f"{what} gives {count} output elements but {against} gives {wanted}: the forward's output size depends "
            "on the data (of the sample, or of the batch it runs in), so the per-sample Jacobians do not fit in one "
            "(B, Y, P) tensor; make the output's size fixed (pad or mask it), or call once per sample")


def check_differentiated(output: object, selected: bool, made_of_parameters: bool = False) -> None:
    """Refuse what a Jacobian would differentiate (one sample's output, or what ``output=`` selects from it) where it
    is not one real floating tensor, or where ``output=`` computes with the model's trainable parameters itself
    (``made_of_parameters``: a layer of the model applied to its hidden states, whose parameters would be missed)."""
    what = "what output= selects is" if selected else "this model returns"
    if not isinstance(output, torch.Tensor):
        fix = "return one tensor from output=" if selected else "say which tensor with output="
        keyed = isinstance(output, dict) and not hasattr(output, "logits") and not selected  # no out.logits there
        tensors = [k for k, v in output.items() if isinstance(v, torch.Tensor)] if keyed else []
        key = "logits" if "logits" in tensors else next(iter(tensors), None)
        pick = "out.logits (or out[0])" if key is None else f"out[{key!r}]"
        raise TypeError(f"per_sample_jacobian and empirical_ntk differentiate one output tensor, but {what} a "
                        f"{type(output).__name__}: {fix}, e.g. output=lambda out: {pick}")
    if output.is_complex():
        raise TypeError(f"per_sample_jacobian differentiates real floating outputs, but {what} {output.dtype}: "
                        "pass output=lambda out: torch.view_as_real(out) (its real and imaginary parts as outputs)")
    if not output.is_floating_point():
        raise TypeError(f"per_sample_jacobian differentiates real floating outputs, but {what} {output.dtype}, "
                        "which has no gradient (an argmax, a count): differentiate a floating tensor before it, e.g. "
                        "output=lambda out: out.logits, or return the scores")
    if made_of_parameters:
        raise ValueError("output= computes with trainable parameters itself (a layer of the model applied to what the "
                         "model returns): put that computation inside the model's forward (a wrapper module whose "
                         "forward returns it), so that its parameters are differentiated as the model's")
