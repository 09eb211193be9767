"""Errors that are the user's own (the model's, the loss's), shown as the user's own.

When the user's model or loss fails inside a call, the user sees that one error, once: the package's frames are
taken out of its traceback (what is left runs from the user's call to the user's code that failed), and a note names
the inputs as the package cut them (shapes and dtypes), with the fix for the common mistakes (class-index targets
of shape (B, 1) for cross-entropy, integer inputs to a float model).
"""

from __future__ import annotations

import os
import re
import threading
import traceback
import types

import torch

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.guards import KEPT_TENSOR_FIX

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # .../pergrad_viz/
_TRANSFORMS = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)), "_functorch") + os.sep  # vmap's frames
_NOTE = "pergrad_viz: "

# The package's own warnings.catch_warnings blocks, one at a time: each saves the process's filter list and puts it
# back on exit, so two at once in two threads would put back each other's (a filter of the package's left behind).
FILTERS = threading.RLock()


def _ours(tb: types.TracebackType) -> bool:
    """A frame of the package's machinery: its own code, and torch.func's transforms that it wraps the model in."""
    return tb.tb_frame.f_code.co_filename.startswith((_PACKAGE, _TRANSFORMS))


def is_package_error(error: BaseException) -> bool:
    """Whether ``error`` is one of the package's own exceptions (they keep their tracebacks)."""
    return type(error).__module__.startswith("pergrad_viz")


def drop_package_frames(error: BaseException) -> BaseException:
    """``error`` with the package's frames taken out of its traceback (at least one frame is kept)."""
    kept = []
    tb = error.__traceback__
    while tb is not None:
        if not _ours(tb):
            kept.append(tb)
        tb = tb.tb_next
    if kept:
        for a, b in zip(kept, kept[1:], strict=False):
            a.tb_next = b
        kept[-1].tb_next = None
        error.__traceback__ = kept[0]
    return error


def describe_inputs(inputs: Batch) -> str:
    """``x (64, 1, 28, 28) float32, mask (64, 10) int64``: the call's tensors as the package cut them."""
    return ", ".join(f"{name} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                     for name, t in inputs.named_leaves())


_LOSS_ARGUMENT = re.compile(r"\b(\w+)\(\): argument '(input|target)' \(position \d\) must be Tensor, not (\w+)")
_MODULE_CALL = os.path.join("torch", "nn", "modules", "module.py")


_MODEL_CALLERS = ("batch.py", "functional.py")  # the package's files that call the model (Batch, functional_call)
_LOSS_CALLERS = ("losses.py", "loss_reads.py")  # and the loss


def _failed_in(error: BaseException) -> tuple[str | None, list]:
    """(the file name of the package's last frame in ``error``'s traceback, or None; the frames after it)."""
    frames = traceback.extract_tb(error.__traceback__)
    last = max((k for k, f in enumerate(frames) if f.filename.startswith(_PACKAGE)), default=None)
    return (None, []) if last is None else (os.path.basename(frames[last].filename), frames[last + 1:])


def _at_the_models_call(error: BaseException) -> bool:
    """Whether ``error`` was raised calling the model itself: the package's call of the model, then torch's Module
    call alone (a layer inside it called wrongly has its caller's frame there; a loss of one argument, none)."""
    caller, after = _failed_in(error)
    return caller in _MODEL_CALLERS and bool(after) and all(f.filename.endswith(_MODULE_CALL) for f in after)


def _hint(error: BaseException, inputs: Batch, targets: object) -> str | None:
    text = str(error)
    if isinstance(targets, torch.Tensor) and not targets.is_floating_point() and targets.dim() == 2 \
            and targets.shape[1] == 1 and ("target" in text or "multi-target" in text):
        return ("the targets have shape (B, 1): cross-entropy takes class indices of shape (B,); pass "
                "targets.squeeze(1) (or targets.view(-1))")
    if "Inference tensors cannot be saved for backward" in text:
        made = [f"'{n}'" for n, t in inputs.named_leaves() if t.is_inference()]
        return ("a tensor the backward passes through was created under torch.inference_mode() (a frozen "
                "parameter or a buffer of a model built or loaded there" + (f"; or {made[0]}" if made else "") +
                "): build or load the model outside inference_mode (torch.no_grad() is fine there)")
    if "backward through the graph a second time" in text:
        return ("the model's forward reuses a tensor that an earlier forward computed from the parameters and kept "
                "(a cache across calls, such as the attention_bias_cache of timm's LeViT and EfficientViT in eval "
                "mode): that forward's backward freed its graph, and this call runs the model more than once (the "
                "probe, the check, a sample at a time), so plain loss.backward() would fail the same way on its "
                f"second step. {KEPT_TENSOR_FIX}")
    if "unexpected keyword argument" in text and inputs.kwargs and not inputs.args:
        return ("a dict of inputs is passed as keyword arguments, model(**inputs), as a tokenizer's BatchEncoding is; "
                "for a model that takes the dict itself, model(d), pass it inside a tuple: inputs=(d,)")
    if "positional argument" in text and len(inputs.args) > 1 and not inputs.kwargs:
        return (f"inputs is a sequence of {len(inputs.args)} tensors, so the model was called as model(*inputs); a "
                "DataLoader batch [x, y] is passed as inputs=x, targets=y (pv.per_sample_grads(model, loss_fn, x, y))")
    if "must be Tensor, not" in text and "Output" in text:  # a Hugging Face ModelOutput handed to a torch.nn loss
        return ("the model returns a ModelOutput, not a tensor: use loss_fn=pv.sequence_classification_loss or "
                "pv.causal_lm_loss, or one that reads its logits, lambda out, y: F.cross_entropy(out.logits, y)")
    argument = _LOSS_ARGUMENT.search(text) if "must be Tensor, not" in text else None  # a torch function's own check
    caller = _failed_in(error)[0] if argument is not None else None
    loss = caller in _LOSS_CALLERS  # in the loss's call (a torch.nn loss, or the user's own), not the model's
    if loss and argument.group(2, 3) == ("target", "NoneType") and targets is None:
        return ("targets=None, so the loss was called as loss_fn(output, None): pass the targets (targets=None is for "
                "a loss of the output alone, loss_fn=lambda out, _: out.square().sum())")
    if loss and argument[2] == "input" and argument[3] in ("tuple", "dict", "list"):  # the model's several outputs
        pick = "out['logits']" if argument[3] == "dict" else "out[0]"
        return (f"the model returns a {argument[3]}, not a tensor: give the loss the tensor it reads, e.g. "
                f"loss_fn=lambda out, y: F.cross_entropy({pick}, y) (with the key or index of yours)")
    if caller in _MODEL_CALLERS and argument.group(2, 3) == ("input", "tuple"):  # inside the model
        return (f"a layer inside the model ({argument[1]}) was given a tuple: nn.LSTM, nn.GRU and nn.RNN return "
                "(output, state) and nn.MultiheadAttention (output, weights); take [0] of it in the forward")
    if "target with class probabilities, got Long" in text or "target with class probabilities, got Int" in text:
        return ("the targets hold integers of shape (B, classes), one-hot labels: cross-entropy takes class indices "
                "(B,) as integers, targets.argmax(1), or class probabilities as floats, targets.float()")
    if "'indices'" in text and "Long, Int" in text:  # token ids in a float tensor, into an Embedding
        floats = [name for name, t in inputs.named_leaves()  # whole numbers >= 0 in a float tensor: ids, not features
                  if t.is_floating_point() and t.layout == torch.strided and t.device.type == "cpu" and t.numel()
                  and bool(((t == t.round()) & (t >= 0)).all())]
        if floats:
            return f"'{floats[0]}' holds floating-point numbers but an Embedding takes integer ids: pass it as .long()"
    if ".forward() takes 1 positional argument but 2 were given" in text and len(inputs.args) == 1 \
            and not inputs.kwargs and _at_the_models_call(error):
        return ("the model was called as model(x), and its forward takes no positional input (keyword arguments "
                "only?): pass a dict, inputs={'x': x}, which is called as model(**inputs)")
    if "expected target dtype to be Long" in text or ("target" in text and "Float" in text and "Long" in text):
        return ("cross-entropy takes class indices as integers: pass targets.long() (or class probabilities of shape "
                "(B, classes))")
    leaves = inputs.named_leaves()
    # a vector as long as the batch after the first input (which holds the samples), or a square (T, T) with T == B
    square = ([name for name, t in leaves[1:] if t.dim() == 1 and t.shape[0] == inputs.size]
              or [name for name, t in leaves if t.dim() == 2 and t.shape[0] == t.shape[1] == inputs.size])
    if square and any(w in text for w in ("must match", "size of tensor", "shape", "broadcast")):
        return (f"'{square[0]}' has the batch size ({inputs.size}) first and is cut per sample like every such "
                "tensor; if it is shared by all samples (a (T, T) mask with T equal to the batch size), keep it in the "
                "model (a buffer, or made in its forward) or call with another batch size")
    dtype_words = ("expected scalar type", "must have the same dtype", "found Long", "found Int", "dtype")
    ints = [name for name, t in inputs.named_leaves() if not t.is_floating_point() and not t.is_complex()]
    if ints and any(w in text for w in dtype_words):
        return (f"the input tensor '{ints[0]}' holds integers but the model computes in floating point: pass "
                "it as .float() (or .to(the model's dtype)); integer inputs are for models that start with an "
                "Embedding")
    whole = [(name, t) for name, t in inputs.named_leaves() if t.dim() == 0 or t.shape[0] != inputs.size]
    if whole and len(whole) < len(inputs.named_leaves()):
        names = ", ".join(repr(n) for n, _ in whole)
        second = next(((n, t) for n, t in whole if t.dim() >= 2 and t.shape[1] == inputs.size), None)
        why = ""
        if second is not None:
            why = (f"; '{second[0]}' {tuple(second[1].shape)} has the samples along dimension 1 (an RNN's (layers, B, "
                   "H) state, a time-major (T, B, F) sequence): pass it batch-first (h0.transpose(0, 1).contiguous(), "
                   "batch_first=True) and transpose it back inside the forward")
        elif targets is None and inputs.size == 1:
            why = "; targets=None, so B was read from the first input tensor: put the samples' tensor first"
        return (f"B = {inputs.size}, and {names} (first dimension not {inputs.size}) went "
                "whole to every sample's run while the others were cut: a tensor that belongs to the samples but is "
                "not batch-first (EmbeddingBag's flat token ids with offsets, an attention mask of shape (B * heads, "
                "T, T)) cannot be cut; pass each sample's own rows first (padded (B, L) ids, a (B, T, T) mask "
                f"repeated over the heads inside the forward){why}")
    return None


def users_error(error: BaseException, inputs: Batch, targets: object = None) -> BaseException:
    """``error`` (raised by the user's model or loss inside a call) with a note naming the call's inputs, and the
    fix where the mistake is a common one. The error itself is unchanged: the same type and message."""
    if is_package_error(error) or isinstance(error, (MemoryError, KeyboardInterrupt)):
        return error
    if any(str(n).startswith(_NOTE) for n in getattr(error, "__notes__", ())):
        return error
    error.add_note(f"{_NOTE}the call's inputs: {describe_inputs(inputs)} (the model runs on them whole, on one or "
                   "two samples (the probe), or one sample at a time: every tensor whose first dimension is the batch "
                   "size cut alike)")
    try:
        hint = _hint(error, inputs, targets)
    except Exception:  # noqa: BLE001 - a hint is a courtesy: it never replaces the user's own error
        hint = None
    if hint is not None:
        error.add_note(_NOTE + hint)
    return error
