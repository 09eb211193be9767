"""What a call works on: the model's trainable parameters, checks of the model's modes, the guard
that leaves the user's model as it was found."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import os
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from pergrad_viz.core.kept_state import copies, has_user_hooks, hooks_since, same_values, values_changed
from pergrad_viz.core.process import leaving_process_as_found
from pergrad_viz.core.randomness import random_state, set_random_state
from pergrad_viz.core.users import drop_package_frames, is_package_error
from pergrad_viz.core.validate import check_model
from pergrad_viz.errors import UndefinedPerSampleError

if TYPE_CHECKING:
    from pergrad_viz.core.batch import Batch



@dataclass
class CallState:
    """What one call works out once and reads again (a :class:`Trainable` is made per call): the plan and its key
    (``engine.probe.plan_for``), the layers the hooked forward hooks (``engine.capture``), and the result with the
    views the strategy wrote through (``api``, for the per-call check)."""

    plan: object = None
    key: tuple | None = None  # the plan's key (engine.plan_key), read once per call
    layers: dict | None = None
    rows: tuple | None = None
    draws: object = None  # core.randomness.Draws under randomness='different', else None (refused)
    graphs: set = field(default_factory=set)  # the graphs between the layers this call's backwards took
    checked: bool = False  # the per-call check may run on this call (verify=True): api._checked sets it
    due: bool = False  # the check's schedule checks this call (api._checked, before the strategy runs)
    combination: tuple | None = None  # (w (B,), {name: sum_i w_i g_i}): engine.combination's, formed in the pass
    input_versions: tuple = ()  # the inputs' version counters as the call found them (validate.check_inputs_kept)
    offers_randomness: bool = False  # the call takes randomness= (its refusals of random forwards may name it)


@dataclass(frozen=True)
class Trainable:
    """A model and its trainable parameters, in ``named_parameters()`` order."""

    model: nn.Module
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    modules: tuple[tuple[str, nn.Module], ...]  # named_modules(), walked once per call
    call: CallState = field(default_factory=lambda: CallState(), compare=False, repr=False)  # this call's state
    select: Callable[[object], torch.Tensor] | None = None  # the output tensor a Jacobian differentiates
    named_parameters: tuple[tuple[str, nn.Parameter], ...] = ()  # all of them, frozen ones too, read by of()

    def selecting(self, select: Callable[[object], torch.Tensor]) -> Trainable:
        """The same trainable parameters, with Jacobians of ``select(model output)``; TypeError where it is not
        callable (``output="logits"``)."""
        if not callable(select):
            raise TypeError(f"output= must be a function of what the model returns, e.g. output=lambda out: "
                            f"out.logits or operator.itemgetter('logits'), got {type(select).__name__} {select!r:.40}")
        kept = CallState(input_versions=self.call.input_versions, offers_randomness=self.call.offers_randomness)
        return dataclasses.replace(self, select=select, call=kept)

    def outputs(self, batch: Batch) -> torch.Tensor | object:
        """The model's output on ``batch``, or the tensor ``select`` picks from it (what a Jacobian differentiates)."""
        out = batch(self.model)
        return out if self.select is None else self.select(out)

    @classmethod
    def of(cls, model: nn.Module) -> Trainable:
        if not isinstance(model, nn.Module):
            check_model(model)  # raises, naming the fix
        modules = tuple(model.named_modules())
        everything = _named_parameters(model, modules)
        named = check_model(model, everything)
        names, params = zip(*named, strict=True)
        return cls(model, tuple(names), tuple(params), modules, named_parameters=everything)

    @property
    def shapes(self) -> dict[str, torch.Size]:
        return {n: p.shape for n, p in zip(self.names, self.params, strict=True)}

    @property
    def num_params(self) -> int:
        """P, the number of trainable scalars."""
        return sum(p.numel() for p in self.params)

    @property
    def largest_param(self) -> int:
        """The number of elements of the largest trainable parameter."""
        return max(p.numel() for p in self.params)

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    def frozen_state(self) -> dict[str, torch.Tensor]:
        """Frozen parameters and buffers, by name, for ``torch.func.functional_call``: each tensor once, and none that
        is a trainable parameter (a buffer registered as another module's Parameter: ``functional_call`` ties the
        names of one tensor, and would refuse two values for them)."""
        seen = {id(p) for p in self.params}
        state = {}
        for n, t in [*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers()]:
            if t is not None and id(t) not in seen:
                seen.add(id(t))
                state[n] = t
        return state


def _named_parameters(model: nn.Module, modules: tuple[tuple[str, nn.Module], ...]
                      ) -> tuple[tuple[str, nn.Parameter], ...]:
    """``tuple(model.named_parameters())`` read from ``modules`` (its ``named_modules()``, just walked), as
    ``nn.Module`` lists them (each parameter once, under its first name), without a second walk of the model; a model
    whose class defines its own ``named_parameters`` or ``named_modules`` is asked itself."""
    if type(model).named_parameters is not _NAMED_PARAMETERS or type(model).named_modules is not _NAMED_MODULES:
        return tuple(model.named_parameters())
    seen: set[int] = set()
    named = []
    for prefix, module in modules:
        for key, p in module._parameters.items():
            if p is None or id(p) in seen:
                continue
            seen.add(id(p))
            named.append((f"{prefix}.{key}" if prefix else key, p))
    return tuple(named)


_NAMED_PARAMETERS, _NAMED_MODULES = nn.Module.named_parameters, nn.Module.named_modules


def _same_objects(now: dict, saved: dict) -> bool:
    """Whether the dict ``now`` holds the very objects ``saved`` held, under the same keys."""
    if not saved:
        return not now
    return now.keys() == saved.keys() and all(map(operator.is_, map(now.__getitem__, saved), saved.values()))


@contextlib.contextmanager
def restoring_modes(model: nn.Module | Trainable, keep_parameters: bool = False) -> Iterator[None]:
    """Leave ``model`` as it was found, and compute gradients whatever the caller's grad mode.

    Inside: gradients are recorded even under the caller's ``torch.no_grad()`` or ``torch.inference_mode()`` (the
    per-sample definition does not depend on them). On exit, even on error: every module's training flag, every
    module's parameter and buffer objects (``torch.func`` can leave plain tensors where a module reachable under two
    names had Parameters), every buffer's values and every attribute object (a state the forward keeps, ``self.h =
    h.detach()``, as the model had it: the probe's runs on one or two samples leave their own) are as they were. A
    forward pass that wrote a buffer (running statistics, ``spectral_norm``'s power iteration) is undone and, if
    nothing else failed, refused with :class:`UndefinedPerSampleError`: computing per-sample gradients must not change
    the model. A parameter written in place (a running statistic kept as a frozen Parameter) is refused alike, and
    undone where ``keep_parameters`` kept a copy (the first runs of a model: the probe, a loop's look at sample 0;
    of a large model only its small parameters, :data:`KEPT_PARAMETER_BYTES`).

    Strategies never call ``backward()`` (so ``.grad`` is untouched) and remove their own hooks.
    """
    named = model.modules if isinstance(model, Trainable) else tuple(model.named_modules())
    flags = [m.training for _, m in named]
    script = torch.jit.ScriptModule  # TorchScript keeps its own
    hooked = has_user_hooks(named)  # a user's hook may keep a count on any module (self.calls += 1)
    kept = [(n, m, dict(m._parameters), dict(m._buffers),
             None if _stateless(type(m)) and not hooked else dict(m.__dict__), dict(m._modules))
            for n, m in named if not isinstance(m, script)]
    found = {}  # id -> (name, tensor, version)
    for name, _m, _params, bufs, _attributes, _modules in kept:
        for bname, b in bufs.items():
            if b is not None and id(b) not in found and not b.is_inference():
                found[id(b)] = (f"{name}.{bname}" if name else bname, b, b._version)
    kept_buffers = copies([b for _, b, _ in found.values()])
    buffers = {key: (*entry, copy) for (key, entry), copy in zip(found.items(), kept_buffers, strict=True)}
    # (name, parameter, version): one written in place by the forward is refused (and undone); every parameter once,
    # from the call's own walk where it made one
    if isinstance(model, Trainable):
        every = model.named_parameters or tuple(model.model.named_parameters())
    else:
        every = tuple(model.named_parameters())
    owned = [(name, p, p._version) for name, p in every if not p.is_inference()]
    kept_values: list = [None] * len(owned)
    if keep_parameters:  # all of a small model's; of a large one the small tensors (running statistics, norms' scales)
        small = sum(p.nbytes for _, p, _ in owned) <= KEPT_PARAMETER_BYTES
        picked = [k for k, (_, p, _) in enumerate(owned) if small or p.numel() <= KEPT_PARAMETER_ELEMENTS]
        with torch.no_grad():
            for k, value in zip(picked, copies([owned[k][1] for k in picked]), strict=True):
                kept_values[k] = value
    failed: BaseException | None = None
    first_hook = torch.utils.hooks.RemovableHandle.next_id  # hooks numbered from here on: registered in the call
    try:
        with torch.inference_mode(False), torch.enable_grad():
            yield
    except BaseException as e:  # raised again below, or a refusal naming the write that caused it
        failed = e
    finally:
        for (_, m), flag in zip(named, flags, strict=True):
            if m.training != flag:
                m.training = flag
        replaced, made, lazy = [], [], None  # made: layers and parameters the forward created (self.fc = Linear)
        known: set[int] | None = None  # the model's parameters before the call, read only where one was registered
        for name, m, params, bufs, attributes, modules in kept:
            if attributes is not None and not _same_objects(m.__dict__, attributes):  # self.h = h.detach()
                for added in m.__dict__.keys() - attributes.keys():
                    lazy = lazy if lazy is not None else hooks_since(named, first_hook)  # a mark kept with its hooks
                    if not (lazy and type(m.__dict__[added]) in _MARKS):
                        del m.__dict__[added]
                m.__dict__.update(attributes)
            for now, before in ((m._parameters, params), (m._modules, modules)):
                if not _same_objects(now, before):
                    known = {id(p) for _, p in every} if known is None else known
                    made += [f"{name}.{k}" if name else k for k, v in now.items()
                             if v is not before.get(k) and _new_trainable(v, known)]
                    now.clear()
                    now.update(before)
            if not _same_objects(m._buffers, bufs):
                replaced += [f"{name}.{k}" if name else k for k in m._buffers.keys() | bufs.keys()
                             if not same_values(m._buffers.get(k), bufs.get(k))]  # the same values: no change
                m._buffers.clear()
                m._buffers.update(bufs)
        entries = list(buffers.values())
        unseen = values_changed([b for _, b, _, _ in entries], [c for *_, c in entries])  # no version counted
        undone = [(name, b, copy) for (name, b, version, copy), other in zip(entries, unseen, strict=True)
                  if b._version != version or other]
        for _name, b, copy in undone:
            with torch.no_grad():
                if b.shape != copy.shape:  # a forward that resized it (an observer's statistics)
                    b.resize_(copy.shape)
                b.copy_(copy)
        written = [name for name, _, _ in undone]
        changed = [(name, p, value) for (name, p, version), value in zip(owned, kept_values, strict=True)
                   if p._version != version]
        for _name, p, value in changed:
            if value is not None:
                with torch.no_grad():
                    p.copy_(value)
    error = failed  # a refusal of the probe (outputs that differ between runs) gives way to the write that caused it
    failed = failed if isinstance(failed, UndefinedPerSampleError) and (written or replaced) else failed is not None
    if made and failed is not True:
        raise UndefinedPerSampleError(
            f"the forward pass creates '{made[0]}' as it runs (self.fc = nn.Linear(...) or nn.Parameter(...) inside "
            "forward), so each run would make another one and per-sample gradients would be of parameters your model "
            "does not have. It was taken out again. Create it in __init__, or run one forward pass before the call."
        ) from (failed or None)
    if changed and not failed:
        name, _, value = changed[0]
        raise UndefinedPerSampleError(
            f"the forward pass writes the parameter '{name}' in place (a running statistic kept as a frozen "
            "nn.Parameter, a weight constraint applied inside forward), so computing per-sample gradients would change "
            f"your model and each sample would see another model{'' if value is None else '. It was restored'}. Keep "
            "such state in a buffer (register_buffer: then model.eval() stops its updates) or apply the constraint "
            "outside the forward."
        )
    if replaced and failed is not True:
        raise UndefinedPerSampleError(
            f"the forward pass assigns a new tensor to the registered buffer '{replaced[0]}' (self.x = ..., "
            "register_buffer inside forward), so computing per-sample gradients would change your model and each "
            "sample would see another model. The buffer was put back. Keep such a value in a local variable or a plain "
            "attribute, or register the buffer once in __init__ and update it outside the forward."
        ) from (failed or None)
    if written and failed is not True:
        owner = dict(zip((n for n, _ in named), flags, strict=True)).get(written[0].rpartition(".")[0], True)
        fix = ("If it writes in training mode only (running statistics), call model.eval() first; if in eval mode "
               "too (a step counter, " if owner else "It does so in eval mode too (a step counter, ")
        raise UndefinedPerSampleError(
            f"the forward pass writes the buffer '{written[0]}' (e.g. running statistics in training mode, "
            "spectral_norm's power iteration, or through .data / numpy), so computing per-sample gradients would "
            f"change your model and each sample would see another model. The buffer was restored. {fix}self.steps += "
            "1), keep such a value as a plain Python attribute, not a registered buffer, or update it outside the "
            "forward; a FakeQuantize or observer: model.apply(torch.ao.quantization.disable_observer)."
        ) from (failed or None)
    if error is not None:
        raise error


# The types of an attribute a forward added in a call that left hooks, kept with them (the mark they are installed)
_MARKS = frozenset((bool, int, float, str, type(None)))
# The copy ``restoring_modes(keep_parameters=True)`` keeps: every parameter of a model of at most this many bytes,
# else the parameters of at most this many elements (a large model's weights are not doubled in memory).
KEPT_PARAMETER_BYTES = 64 << 20
KEPT_PARAMETER_ELEMENTS = 1 << 16


def _new_trainable(value: object, known: set[int]) -> bool:
    """Whether a module or parameter the forward registered holds a trainable parameter the model did not have (not
    a cache of parameter-free layers, a buffer-only module, a frozen tensor or an alias of one of its own layers);
    True where that cannot be read (a module whose parameters() fails: the restore goes on, the refusal names it)."""
    try:
        params = [value] if isinstance(value, nn.Parameter) else list(value.parameters()) \
            if isinstance(value, nn.Module) else []
        return any(p.requires_grad and id(p) not in known for p in params)
    except Exception:  # noqa: BLE001 - inside the restore: nothing may stop it halfway
        return True


@functools.cache
def _stateless(kind: type) -> bool:
    """Whether a module type is PyTorch's own (``torch.nn.Linear``, ...), whose forward keeps no attribute."""
    return kind.__module__.startswith("torch.")


def computing_gradients(fn: Callable) -> Callable:
    """Decorator for a public entry point: its body runs with gradients recorded and outside inference mode, whatever
    the caller's mode, so that what it allocates (results, norms) are normal tensors it may write into; one call at a
    time per model (:func:`_one_thread_at_a_time`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        model = args[0] if args else kwargs.get("model")
        drawn = random_state(_device(model)) if kwargs.get("randomness") == "different" else None
        try:
            with leaving_process_as_found(), _one_thread_at_a_time(model), torch.inference_mode(False), \
                    torch.enable_grad():
                return fn(*args, **kwargs)
        except Exception as e:
            if drawn is not None:  # a refusal after a forward drew its masks: the caller's generator as it was
                set_random_state(_device(model), drawn)
            if not is_package_error(e):  # the model's or the loss's own error: shown from the user's frames
                drop_package_frames(e)
            raise

    return wrapper


def _device(model: object) -> torch.device:
    p = next(model.parameters(), None) if isinstance(model, nn.Module) else None
    return torch.device("cpu") if p is None else p.device


# id(module) -> (a weak reference to it, its lock): by identity, as a module's own __eq__ / __hash__ (or none) must not
# give two modules one lock, or a module none; an entry goes with its module
_CALL_LOCKS: dict[int, tuple[weakref.ref, threading.RLock]] = {}
_CALL_LOCKS_LOCK = threading.RLock()  # re-entrant: a collection while it is held may drop an entry (_drop_lock)


def _lock_of(module: nn.Module) -> threading.RLock:
    """The lock of ``module`` (made on first use); the caller holds ``_CALL_LOCKS_LOCK``."""
    entry = _CALL_LOCKS.get(id(module))
    if entry is None or entry[0]() is not module:
        entry = _CALL_LOCKS[id(module)] = (weakref.ref(module, functools.partial(_drop_lock, id(module))),
                                           threading.RLock())
    return entry[1]


def _drop_lock(key: int, ref: weakref.ref) -> None:
    with _CALL_LOCKS_LOCK:
        if _CALL_LOCKS.get(key, (None,))[0] is ref:
            del _CALL_LOCKS[key]


def _forget_locks() -> None:
    """In a forked child: the locks afresh (one held by a thread of the parent mid-call would never be released)."""
    global _CALL_LOCKS, _CALL_LOCKS_LOCK
    _CALL_LOCKS, _CALL_LOCKS_LOCK = {}, threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_locks)


@contextlib.contextmanager
def _one_thread_at_a_time(model: object) -> Iterator[None]:
    """Calls that reach one module from several threads run one at a time: a call hooks the model's layers, so that
    two at once would each capture the other's forward (they failed with plan mismatches, and two models sharing a
    trunk gave wrong rows). Each module has its lock, taken in one order (by id) by every call: two models sharing a
    layer take turns, models sharing nothing do not wait. Re-entrant: a call the package makes inside another, in the
    same thread, passes."""
    if not isinstance(model, nn.Module):
        yield
        return
    modules = {id(m): m for m in model.modules()}
    with _CALL_LOCKS_LOCK:
        locks = [_lock_of(modules[key]) for key in sorted(modules)]
    taken = 0
    try:
        for lock in locks:
            lock.acquire()
            taken += 1
        yield
    finally:
        for lock in reversed(locks[:taken]):
            lock.release()
