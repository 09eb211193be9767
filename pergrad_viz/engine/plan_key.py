"""The key under which a plan (:mod:`pergrad_viz.engine.probe`) is cached: what can change it structurally, read
afresh on every call (a value changed since the plan was made must be seen)."""

from __future__ import annotations

import enum
import functools
import itertools
import operator
import sys
import types
import weakref
from collections import OrderedDict

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from pergrad_viz.core.batch import Batch
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.observe import PLAIN_LEAVES
from pergrad_viz.engine.volatile import skipped

_PLAIN = PLAIN_LEAVES
_EXACTLY_PLAIN = frozenset(_PLAIN)  # a value of exactly one of these types is plain: no isinstance needed
_NEVER_PLAIN = frozenset((dict, OrderedDict, set))  # nn.Module's own bookkeeping (hooks, _parameters, ...)
# nn.Module's own containers (hooks, _parameters, _modules, ...): never read here, passed over first
_BOOKKEEPING = frozenset(k for k, v in vars(nn.Module()).items() if isinstance(v, (dict, set)))


def _plain_attributes(module: nn.Module, settings: dict[int, tuple], held: bool = False) -> tuple:
    """The module's attributes that are plain values (bools, numbers, strings, None, enum members, tuples / lists of
    them): what a forward may branch on (``self.task``, ``self.center``), so a plan made with other values does not
    describe it. A settings object it holds (:func:`_role`) counts by its identity here, its plain fields read into
    ``settings`` once per call however many modules share it; a dict of its own by its plain items.

    Read on every call (a value changed since the plan was made must be seen); the exact-type tests first only skip
    the ``isinstance`` calls (a subclass of a plain type, an ``IntEnum`` flag, still counts). ``held`` (the plan's
    key): a tensor attribute by its values or identity and version too (:func:`_state_of`), also in a list, tuple or
    dict it holds, a small numpy array by its values, a function attribute by its code (:func:`_hook`)."""
    items: list = []
    for k, v in module.__dict__.items():
        if k in _BOOKKEEPING:
            continue
        kind = type(v)
        if kind in _EXACTLY_PLAIN:
            items.append((k, v))
            continue
        if kind is torch.Tensor:
            if held:
                _add_held(items, k, v)
            continue
        role = _ROLES.get(kind)
        if role is None:
            role = _ROLES[kind] = _role(kind, v)
        if role == _DICT:
            if not k.startswith("_"):
                items.append((k, _plain_fields(v)))
                if held:
                    _add_held_within(items, k, v.values())
        elif role == _MAYBE_PLAIN:
            if (plain := _plain(v)) is not _NOT_PLAIN:
                items.append((k, plain))
            elif held:
                _add_held_within(items, k, v)
        elif role == _SKIP and held:
            if isinstance(v, torch.Tensor):  # a subclass: by identity and version (_add_held)
                _add_held(items, k, v)
            elif _is_array(v):
                _add_array(items, k, v)
        elif role == _SETTINGS:
            if id(v) not in settings:
                settings[id(v)] = _plain_fields(vars(v))
            items.append((k, id(v)))
        elif role == _CODE and held:
            items.append((k, _hook(v)))  # a function the forward calls (self.f = lambda h: ...): by its code
    return tuple(items)


def _state_of(module: nn.Module, settings: dict[int, tuple]) -> tuple:
    """:func:`_plain_attributes`, then the tensors the module holds that are not trained (tensor attributes, buffers,
    frozen parameters), by their values or their identity and version counter (:func:`_add_held`), as numbers: a
    value a forward may scale a coupling by (``h + self.mix * h.mean(0)``) written in place (``mix.fill_(0.5)``) or
    replaced changes the key, so the plan is probed again with it. A tensor written on every call (a counter, an EMA)
    is left out once two probes found the same plan (:mod:`~pergrad_viz.engine.volatile`), as a number attribute is."""
    items = _plain_attributes(module, settings, held=True)
    extra: list = []
    for k, t in module._buffers.items():
        if t is not None:
            _add_held(extra, k, t)
    for k, p in module._parameters.items():
        if p is not None and not p.requires_grad:
            _add_held(extra, k, p)
    return items + tuple(extra) if extra else items


def _add_held(items: list, name: object, t: torch.Tensor) -> None:
    """A held tensor's key items: a plain one on a CPU by its values where small (a scale, a flag: at most
    :data:`_SMALL` numbers, one item each, as a number attribute is keyed) or by a digest of its bytes up to
    :data:`_DIGESTED` numbers (a mask), so that one written every step with the same values (a ``mix`` kept 0 and
    then ramped) changes the key only when its values do; any other (on a device: read without a synchronisation;
    a subclass, a nested tensor: its values may not read plainly) by its identity and version counter, or by its
    identity alone where even that cannot be read (a tensor a forward under vmap left in a list)."""
    try:
        if type(t) in _PLAIN_TENSORS and t.is_cpu and t.dtype in _READABLE and t.layout is torch.strided \
                and not t.is_nested and t.numel() <= _DIGESTED:
            form = (name, tuple(t.shape), t.dtype)  # in the items' names: another shape or dtype is another key
            if t.numel() <= _SMALL:
                for i, v in enumerate(_values(t.detach().flatten().tolist())):
                    items.append(((*form, i), v))
            else:
                items.append(((*form, "digest"), _digest(t)))
            return
        version = -1 if t.is_inference() else t._version
    except Exception:  # a tensor that no longer reads (escaped from a transform): its identity alone
        items.append(((name, "id"), id(t)))
        return
    items.append(((name, "id"), id(t)))
    items.append(((name, "version"), version))


def _digest(t: torch.Tensor) -> int:
    """A digest of a CPU tensor's bytes (of a copy: numpy would pin the tensor's own storage, which then could not be
    resized, as FSDP frees a frozen one), made again only when its version counter or its data's address moved (a
    frozen model's many biases cost a dictionary lookup each on every call, not a hash of their bytes). A write
    through ``.data`` in place moves neither: not seen here (the per-call check's), as on a larger tensor."""
    state = (-1 if t.is_inference() else t._version, t.data_ptr())
    seen = _DIGESTS.get(id(t))
    if seen is not None and seen[0]() is t and seen[1] == state and state[0] != -1:
        return seen[2]
    copy = t.detach().clone(memory_format=torch.contiguous_format)
    digest = hash(copy.view(-1).view(torch.uint8).numpy().tobytes())
    key = id(t)
    _DIGESTS[key] = (weakref.ref(t, lambda _, key=key: _DIGESTS.pop(key, None)), state, digest)
    return digest


_DIGESTS: dict[int, tuple] = {}  # id -> (a weak reference to the tensor, (its version, its address), its digest)
_PLAIN_TENSORS = frozenset((torch.Tensor, nn.Parameter))
_READABLE = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
                       torch.int32, torch.int64, torch.uint8, torch.bool))
_DIGESTED = 4096  # numbers of a CPU tensor read as a digest of its bytes (some microseconds); past it, its version


def _add_held_within(items: list, name: str, values) -> None:
    """The tensors and arrays among the first :data:`_SMALL` values of a list, tuple or dict a module holds
    (``self.scales = [torch.tensor(0.0)]``), each as :func:`_add_held` keys one, by its place."""
    for i, v in enumerate(itertools.islice(values, _SMALL)):
        if isinstance(v, torch.Tensor):
            _add_held(items, (name, i), v)
        elif _is_array(v):
            _add_array(items, (name, i), v)


def _is_array(v: object) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(v, (numpy.ndarray, numpy.generic))


def _add_array(items: list, name: object, v) -> None:
    """A numpy value a module holds: a small one by its values (a permutation, a scale); a larger one not read."""
    if v.size <= _SMALL and v.dtype.kind in "biuf":
        for i, e in enumerate(_values(v.ravel().tolist())):
            items.append(((name, i), e))


_SKIP, _DICT, _MAYBE_PLAIN, _SETTINGS, _CODE = range(5)
_FUNCTIONS = (types.FunctionType, types.MethodType, types.BuiltinFunctionType, functools.partial)
_ROLES: dict[type, int] = {}  # an attribute's type -> what the key reads of it (the same for every value)


def _role(kind: type, value: object) -> int:
    """What the key reads of an attribute of type ``kind`` (``value``, one of them): nothing; a dict's plain items
    (not ``nn.Module``'s underscored bookkeeping); the value, where plain (:func:`_plain`); or, for a settings object
    (``self.config``: a dataclass, a ``SimpleNamespace``, a Hugging Face config: an instance with a ``__dict__``
    that is not a module, tensor, class, function or other callable), its plain fields."""
    if issubclass(kind, dict):
        return _DICT
    if issubclass(kind, (*_PLAIN, enum.Enum, tuple, list)):
        return _MAYBE_PLAIN
    if issubclass(kind, _FUNCTIONS):
        return _CODE
    if kind in _NEVER_PLAIN or callable(value) or not hasattr(value, "__dict__"):
        return _SKIP
    return _SKIP if issubclass(kind, (nn.Module, torch.Tensor, type, types.ModuleType)) else _SETTINGS


_NOT_PLAIN = object()


def _plain(v: object) -> object:
    """``v`` as a key part where it is a plain value, an enum member or a tuple / list of them; else _NOT_PLAIN."""
    if isinstance(v, (*_PLAIN, enum.Enum)):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(e, (*_PLAIN, enum.Enum)) for e in v):
        return tuple(v)
    return _NOT_PLAIN


def _plain_or_type(v: object) -> object:
    plain = _plain(v)
    return type(v) if plain is _NOT_PLAIN else plain


def _plain_fields(fields: dict) -> tuple:
    """The (name, value) pairs of ``fields`` whose values are plain (:func:`_plain`), one level deep."""
    out = []
    for k, v in fields.items():
        if type(v) in _EXACTLY_PLAIN:
            out.append((k, v))
        elif (plain := _plain(v)) is not _NOT_PLAIN:
            out.append((k, plain))
    return tuple(out)


def plan_key(trainable: Trainable, inputs: Batch) -> tuple:
    """What a plan depends on, read afresh: the input signature; per module its name, identity, type, forward (the
    class's and an instance's own), forward hooks (:func:`_hooks`), plain attributes and the tensors it holds
    untrained (:func:`_state_of`); the plain fields of the settings objects the modules hold; the global forward
    hooks; per parameter (``named_parameters()``, frozen ones too, walked once per call by :meth:`Trainable.of`) its
    name, identity, shape, dtype and ``requires_grad``; the call's ``randomness=`` and ``output=``."""
    settings: dict[int, tuple] = {}
    skip = skipped(trainable.model)
    return (
        inputs.signature(),
        tuple((n, id(m), type(m), type(m).forward, m.__dict__.get("forward"),
               _hooks(m._forward_hooks, m._forward_pre_hooks),
               _state_of(m, settings) if n not in skip else _without(_state_of(m, settings), skip[n]))
              for n, m in trainable.modules),
        tuple(settings.items()),
        _hooks(module_mod._global_forward_hooks, module_mod._global_forward_pre_hooks),
        tuple((n, id(p), tuple(p.shape), p.dtype, p.requires_grad)
              for n, p in trainable.named_parameters or trainable.model.named_parameters()),
        trainable.call.draws is not None,  # randomness='different': a plan probed with the draws held fixed
        selection_key(trainable.select),  # output=: what the probe saw selected (engine.selection)
    )


def _hooks(forward: dict, pre: dict) -> tuple:
    """Forward hooks and pre-hooks by what runs (:func:`_hook`), not by their number: a hook swapped for one that
    centres the outputs over the batch changes the key; a hook made anew each step from the same code, or one that
    counts its calls, does not (what it holds is not read: a counter would probe every call)."""
    if not forward and not pre:
        return ()
    return tuple(map(_hook, forward.values())), tuple(map(_hook, pre.values()))


def _hook(hook: object) -> object:
    """A hook's (or a function attribute's) code: a function's, a bound method's (with its object's type), a
    ``functools.partial``'s function's; a builtin (``torch.relu``) itself; a callable object by its type."""
    if isinstance(hook, functools.partial):  # its function and its plain arguments (approximate="tanh")
        return (_hook(hook.func), tuple(map(_plain_or_type, hook.args)),
                tuple((k, _plain_or_type(v)) for k, v in hook.keywords.items()))
    if isinstance(hook, types.MethodType):
        return type(hook.__self__), _hook(hook.__func__)
    if isinstance(hook, types.BuiltinFunctionType):
        return hook
    return hook.__code__ if isinstance(hook, types.FunctionType) else type(hook)


def selection_key(select: object, depth: int = 0) -> object:
    """What identifies an ``output=`` function across calls, as the plan sees a model (by structure): a function by its
    code, default arguments, the values it names (globals: plain ones, tensors, arrays, containers) and what its
    closure holds; a bound method by its function and its object; any other object by its type and its fields (a
    dict by its items, a ``functools.partial`` or ``operator.itemgetter`` by what it was made of); plain values as
    they are, a tensor or array by its shape, dtype and (small) values. Never an ``id``: a new lambda each call is
    the same selection, and a freed one's address is reused by the next. Long containers: their first items."""
    if select is None or type(select) in _EXACTLY_PLAIN:
        return select
    if isinstance(select, torch.Tensor):  # a small one (a scale, a few indices) by its values too
        readable = select.layout == torch.strided and not (select.is_meta or select.is_quantized)
        small = _values(select.detach().flatten().tolist()) if readable and select.numel() <= _SMALL else None
        return "tensor", tuple(select.shape), select.dtype, select.device, small
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(select, (numpy.ndarray, numpy.generic)):
        return "array", select.shape, str(select.dtype), _values(select.ravel()[:_SMALL].tolist())
    if depth > 3:
        return type(select)
    deeper = functools.partial(selection_key, depth=depth + 1)
    if isinstance(select, (tuple, list)):  # a long one by its length and first items: keyed on every call
        return type(select), len(select), tuple(map(deeper, select[:_SMALL]))
    if isinstance(select, dict):
        return tuple((k, deeper(v)) for k, v in itertools.islice(select.items(), _SMALL) if type(k) in _EXACTLY_PLAIN)
    if isinstance(select, functools.partial):
        return functools.partial, deeper(select.func), deeper(select.args), deeper(dict(select.keywords))
    if isinstance(select, types.MethodType):
        return types.MethodType, deeper(select.__func__), deeper(select.__self__)
    if isinstance(select, types.FunctionType):  # (not any object answering __code__: a config's __getattr__)
        code, named = select.__code__, select.__globals__
        return (code, tuple(deeper(_contents(cell)) for cell in (select.__closure__ or ())),
                deeper(select.__defaults__ or ()), deeper(select.__kwdefaults__ or {}),
                tuple((n, deeper(named[n])) for n in code.co_names if n in named and _valued(named[n])))
    if isinstance(select, nn.Module):
        return type(select), _plain_attributes(select, {})
    if isinstance(select, (type, types.ModuleType, types.BuiltinFunctionType)):  # long-lived: itself (held here)
        return select
    made = select.__reduce__() if isinstance(select, (operator.itemgetter, operator.attrgetter)) else None
    return type(select), deeper(made[1] if made else ()), deeper(_fields(select))


_SMALL = 16  # the items of a container (or values of a tensor) a selection's key reads


def _values(values: list) -> tuple:
    """Numbers as a key: NaN as a string (NaN equals nothing, not even the same key's)."""
    return tuple("nan" if v != v else v for v in values)


def _valued(value: object) -> bool:
    """Whether a global a selection names is a value it may switch on (not a module, class or function)."""
    return not isinstance(value, (types.ModuleType, type, types.FunctionType, types.BuiltinFunctionType))


def _fields(select: object) -> dict:
    """An object's fields: its ``__dict__`` and ``__slots__`` (a ``__getattr__`` that raises reads nothing)."""
    fields = {}
    try:
        own = object.__getattribute__(select, "__dict__")
        fields.update(own if isinstance(own, dict) else {})
    except Exception:  # no __dict__ (slots), or one that cannot be read
        pass
    for slot in getattr(type(select), "__slots__", ()):
        try:
            fields[slot] = object.__getattribute__(select, slot)
        except Exception:
            pass
    return fields


def _contents(cell: object) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell (a name not bound yet)
        return None


def _without(attributes: tuple, names: frozenset[str]) -> tuple:
    return tuple(item for item in attributes if item[0] not in names)


def call_key(trainable: Trainable, inputs: Batch) -> tuple:
    """:func:`plan_key` of this call, read once and kept in ``trainable.call.key`` (the probe's ``plan_for`` keeps the
    one it read)."""
    if trainable.call.key is None:
        trainable.call.key = plan_key(trainable, inputs)
    return trainable.call.key
