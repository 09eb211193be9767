"""The probe's runs (:mod:`pergrad_viz.engine.probe`): one forward pass with every module hooked, recording what each
module saw and, on request, where the forward used each trainable parameter or first drew random numbers; and how
two runs' tensors are compared (equal up to rounding, a tolerance per dtype). The run that watches the parameters
also refuses a forward that reaches one through a tensor made before the run (an autograd node with a smaller
sequence number: a cache kept across calls), whose gradient no strategy can give (a freed graph; zeros under vmap)."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from pergrad_viz.core.batch import Batch, as_pytree
from pergrad_viz.core.graph import Nodes
from pergrad_viz.core.guards import KEPT_TENSOR_FIX
from pergrad_viz.core.randomness import DispatchMode
from pergrad_viz.core.tolerances import tolerance
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.errors import UndefinedPerSampleError


def close(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Equal up to rounding: relative to each element and, for the absolute part, to ``scale`` (the magnitude of
    each feature over the probe's runs; default: of ``a`` and ``b`` here), floored at 1% of the largest magnitude in
    the tensor: a small difference next to one very large feature is not hidden by that feature's size."""
    if a.shape != b.shape:
        return False
    if not a.is_floating_point() and not a.is_complex():
        return bool(torch.equal(a, b))
    if a.numel() == 0:
        return True
    rtol, atol = tolerance(a.dtype, a.device).probe
    size = torch.maximum(a.abs(), b.abs()) if scale is None else scale
    size = size.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # infinities (a -inf attention mask) compare equal
    floor = max(float(size.max()) * 1e-2, 1.0)
    ok = (a == b) | ((a - b).abs() <= rtol * b.abs() + atol * size.clamp(min=floor))
    return bool((ok | (a.isnan() & b.isnan())).all())


def outputs_close(a: object, b: object) -> bool:
    """Whether two outputs of a layer hold the same tensors, equal up to rounding (tolerance by dtype)."""
    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(close(x.detach(), y.detach()) for x, y in zip(ta, tb, strict=True))


def tensors_of(obj: object) -> list[torch.Tensor]:
    """The tensors in ``obj`` (a tensor, or nested tuples / lists / dicts of them and other values), in
    ``torch.utils._pytree`` order; the common cases without the pytree machinery (it costs per call)."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if type(obj) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in obj):
        return list(obj)
    found: list[torch.Tensor] = []
    if _plain_containers(obj, found):
        return found
    return [t for t in tree_flatten(as_pytree(obj))[0] if isinstance(t, torch.Tensor)]


PLAIN_LEAVES = (bool, int, float, str, type(None))  # plain values: a flag, a number, a name, None


def _plain_containers(obj: object, found: list[torch.Tensor], depth: int = 0) -> bool:
    """Whether ``obj`` is made of exact tuples, lists and str-keyed dicts (a layer's ``(args, kwargs)``, an
    ``(output, None)`` pair) over tensors and plain values, its tensors appended to ``found`` in pytree order (a
    dict's in its keys' order); False, ``found`` in any state, for anything else (the pytree machinery's)."""
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        found.append(obj)
        return True
    if kind in PLAIN_LEAVES:
        return True
    if depth > 3:
        return False
    if kind is tuple or kind is list:
        return all(_plain_containers(v, found, depth + 1) for v in obj)
    if kind is dict:
        return all(type(k) is str for k in obj) and all(_plain_containers(v, found, depth + 1) for v in obj.values())
    return False


@dataclass
class Record:
    """What every module saw in one probe run: {module name: [(input leaves, output leaves)]}."""

    calls: dict[str, list[tuple[list[torch.Tensor], list[torch.Tensor]]]] = field(default_factory=dict)
    differentiates: bool = False  # the forward ran a backward that built a graph (autograd.grad, create_graph=True)
    autocast: set[str] = field(default_factory=set)  # the modules whose calls ended under torch.autocast
    selected: list[torch.Tensor] | None = None  # what output= selects from the model's output (a Jacobian's)


class _ParameterUses(TorchFunctionMode):
    """Notes, for every torch function that receives a watched parameter and returns a tensor or writes one (``buf[...]
    = p``, peft's OFT), the stack of module names running at that moment (attribute reads such as
    ``p.requires_grad`` return no tensor and do not count)."""

    def __init__(self, watched: dict[int, str], stack: list[str]):
        super().__init__()
        self.watched = watched
        self.stack = stack
        self.uses: dict[str, list[tuple[tuple[str, ...], str]]] = {}
        self.paused = False  # while the probe's own hooks run

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if self.paused:
            return result
        hits = [self.watched[id(t)] for t in tensors_of((args, kwargs)) if id(t) in self.watched]
        written = result is None and args and isinstance(args[0], torch.Tensor)  # buf[...] = p: __setitem__
        if hits and (written or tensors_of(result)):
            for name in hits:
                self.uses.setdefault(name, []).append((tuple(self.stack), getattr(func, "__name__", str(func))))
        return result


class _RandomOps(DispatchMode):
    """Notes the innermost running module at the first operation that draws random numbers (the operations PyTorch
    tags ``nondeterministic_seeded``: bernoulli, rand, randn, randperm, dropout, ...)."""

    def __init__(self, stack: list[str]):
        super().__init__()
        self.stack = stack
        self.first: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (self.first is None and torch.Tag.nondeterministic_seeded in func.tags
                and draws_random_numbers(func, args, kwargs)):
            self.first = self.stack[-1] if self.stack else ""
        return func(*args, **kwargs)


# A seeded operation's arguments that, at 0, mean it draws nothing: attention kernels' ``dropout_p``, dropout's ``p``,
# and the cuDNN / MIOpen RNN kernels' ``dropout`` (``_cudnn_rnn``: an RNN on CUDA, tagged seeded even without dropout).
_RATES = ("dropout_p", "p", "dropout")


def draws_random_numbers(func, args: tuple, kwargs: dict) -> bool:
    """Whether this call of a seeded operation draws: not an attention kernel with ``dropout_p=0``, a dropout with
    ``p=0`` / ``train=False``, an RNN kernel with ``dropout=0`` or RReLU with ``training=False`` (those may take
    random numbers but use none)."""
    schema = func._schema.arguments
    values = {a.name: a.default_value for a in schema if a.has_default_value()}
    values.update({a.name: v for a, v in zip(schema, args, strict=False)})
    values.update(kwargs)
    if any(isinstance(values.get(rate), int | float) and values[rate] == 0 for rate in _RATES):
        return False
    return values.get("train", True) is not False and values.get("training", True) is not False


def observe(trainable: Trainable, inputs: Batch, watch: dict[int, str] | None,
         random_ops: bool = False) -> tuple[Record, dict | str | None]:
    """One hooked forward of ``inputs``: what every module saw, and the parameter uses (``watch``) or, with
    ``random_ops``, the module that first drew random numbers."""
    record = Record()
    stack: list[str] = []
    names = {id(m): n for n, m in trainable.modules}
    mode = None if watch is None else _ParameterUses(watch, stack)
    randomness = _RandomOps(stack) if random_ops else None

    def enter(module, args, kwargs):
        stack.append(names[id(module)])

    def leave(module, args, kwargs, output):
        name = stack.pop() if stack else names[id(module)]
        if mode is not None:
            mode.paused = True
        ins = [t.detach().clone() for t in tensors_of((args, kwargs))]
        outs = [t.detach().clone() for t in tensors_of(output)]
        if mode is not None:
            mode.paused = False
        record.calls.setdefault(name, []).append((ins, outs))
        if outs and torch.is_autocast_enabled(outs[0].device.type):  # inside the forward (around it: the loop's)
            record.autocast.add(name)

    handles = []
    if "torch._dynamo" in sys.modules:  # eager inside a torch.compile'd model (traced, each probe run recompiled them)
        enter, leave = torch.compiler.disable(enter), torch.compiler.disable(leave)
    for _, module in trainable.modules:
        handles.append(module.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(module.register_forward_hook(leave, with_kwargs=True, always_call=True))
    uses: dict = {}
    host_drawn = None  # numpy's or Python's generator's state after a forward that moved it (SpecAugment's masks)
    try:
        with torch.enable_grad():  # the same code paths as the real capture (no inference fast paths)
            if randomness is not None:
                host = _host_random_states()
                with randomness:
                    _note_selected(record, trainable, inputs(trainable.model))
                if randomness.first is None and (end := _host_random_states()) != host:
                    host_drawn = end
                else:
                    return record, randomness.first
            elif mode is None:
                _note_selected(record, trainable, inputs(trainable.model))
            else:
                start = _sequence_number()
                with mode, torch.autograd.graph.saved_tensors_hooks(_noting_backward(record), _unpacked):
                    output = inputs(trainable.model)
                uses = mode.uses
                stale = _stale_parameter(output, inputs, watch, start)
                if stale is not None:
                    raise stale_error(stale)
                _note_selected(record, trainable, output)
    finally:
        for h in handles:
            h.remove()
    if host_drawn is not None:  # random, unless the forward seeds them itself: it then ends alike from elsewhere
        return record, None if _ends_alike(trainable, inputs, host, host_drawn) else ""
    return record, uses


def _ends_alike(trainable: Trainable, inputs: Batch, start: tuple, end: tuple) -> bool:
    """Whether a forward started from other states of the generators it moved (Python's, numpy's) leaves them at
    ``end`` again (``np.random.seed(0)`` before its draws: deterministic); the caller restores them
    (:func:`forked_random`)."""
    if start[0] != end[0]:
        random.seed(0x5EED)
    if start[1] != end[1]:
        sys.modules["numpy"].random.seed(0x5EED)
    with torch.no_grad():
        inputs(trainable.model)
    return _host_random_states() == end


def _host_generators() -> tuple:
    """Python's and numpy's global generators' states (numpy's None where it is not imported)."""
    numpy = sys.modules.get("numpy")
    return random.getstate(), None if numpy is None else numpy.random.get_state()


def _host_random_states() -> tuple:
    """:func:`_host_generators` as values to compare: a forward that draws from them is random too."""
    host, state = _host_generators()
    return host, None if state is None else (state[1].tobytes(), *state[2:])


@contextmanager
def forked_random(device: torch.device) -> Iterator[None]:
    """torch's generators (the CPU's, ``device``'s where a GPU), Python's and numpy's as they were after the block:
    the probe's runs draw nothing from the caller's random state."""
    host, state = _host_generators()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            yield
    finally:
        random.setstate(host)
        if state is not None:
            sys.modules["numpy"].random.set_state(state)


def _note_selected(record: Record, trainable: Trainable, output: object) -> None:
    if trainable.select is not None:
        record.selected = [t.detach().clone() for t in tensors_of(trainable.select(output))]


def _noting_backward(record: Record):
    """A pack hook that marks ``record`` where a tensor is saved while a backward runs: a graph built by the
    backward itself (``torch.autograd.grad(..., create_graph=True)`` inside the forward), whose uses of the
    parameters no layer's forward holds."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        if torch._C._current_graph_task_id() != -1:
            record.differentiates = True
        return t

    return pack


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


def first_difference(first: Record, second: Record) -> str | None:
    """The first module (in the order calls finish: innermost first) that, given the same inputs in two runs of the
    same sample, gave different outputs: a forward that draws random numbers."""

    def same(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> bool:
        return len(xs) == len(ys) and all(close(a, b) for a, b in zip(xs, ys, strict=True))

    for name, calls in first.calls.items():
        for (ins, outs), (ins2, outs2) in zip(calls, second.calls.get(name, []), strict=False):
            if same(ins, ins2) and not same(outs, outs2):
                return name
    return None


def _sequence_number() -> int:
    """The autograd sequence number the next operation of this thread gets: nodes made later have larger ones."""
    with torch.enable_grad():
        return torch.zeros((), requires_grad=True).neg().grad_fn._sequence_nr() + 1


def _stale_parameter(output: object, inputs: Batch, watch: dict[int, str], start: int) -> str | None:
    """The trainable parameter (name) the output reaches through an autograd node made before this forward began
    (sequence number below ``start``): a tensor computed from it in an earlier pass and kept, not through the
    inputs' own history; None where there is none."""
    stop = Nodes(t.grad_fn for t in inputs.leaves())
    seen = {False: Nodes(), True: Nodes()}  # the nodes met on a path through new nodes only, and through an old one
    stack = [(t.grad_fn, False) for t in tensors_of(output) if t.grad_fn is not None]
    while stack:
        node, old = stack.pop()
        if node is None or node in stop or node in seen[old]:
            continue
        seen[old].add(node)
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if variable is not None:
            if old and id(variable) in watch:
                return watch[id(variable)]
            continue
        old = old or node._sequence_nr() < start
        stack.extend((child, old) for child, _ in node.next_functions)
    return None


def stale_error(name: str | None) -> UndefinedPerSampleError:
    """The refusal of a forward that reaches trainable parameter ``name`` (None: one not known) through a tensor kept
    from an earlier pass."""
    which = "a trainable parameter" if name is None else f"the trainable parameter '{name}'"
    return UndefinedPerSampleError(
        f"the forward reaches {which} through a tensor computed from it before this forward pass and kept (a cache "
        "across calls, such as the attention_bias_cache of timm's LeViT and EfficientViT in eval mode, a "
        "parametrization under torch.nn.utils.parametrize.cached(), or a tensor derived from the parameter once, at "
        "construction): its gradient would come from that earlier pass's graph (freed after its backward, or left "
        "out by torch.func, which gives zeros). " + KEPT_TENSOR_FIX)
