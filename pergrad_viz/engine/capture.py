"""Forward hooks capture each layer's inputs and outputs; one backward pass gives the gradients with
respect to the layer outputs (:mod:`pergrad_viz.engine.backward`); per layer, a closed-form rule
(``pergrad_viz.rules``) or, for a layer without one, the per-layer fallback (``torch.func`` on that layer alone)
turns both into per-sample parameter gradients.

What the rules may assume is measured, not assumed (``pergrad_viz.engine.probe``): samples that do not interact,
where each layer's tensors hold the samples, and which layer's forward contains every use of each
trainable parameter. Every call checks the shapes it captured against that plan.

A layer whose call rule has a capturing forward (``nn.MultiheadAttention``: its q / k / v projections) runs that
forward during the pass instead of its own, set as an instance attribute for the pass and removed after it, also
on error; the backward pass then gives the gradients of the tensors it kept as well.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_map

from pergrad_viz.core.batch import Batch, as_pytree, from_pytree
from pergrad_viz.core.guards import REENTRANT_CHECKPOINT, in_reentrant_checkpoint
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine import broadcast
from pergrad_viz.engine.call_shapes import check_call, mismatch
from pergrad_viz.engine.observe import PLAIN_LEAVES, outputs_close, tensors_of
from pergrad_viz.engine.plan import CallSpec, LayerKind, LayerPlan, Plan
from pergrad_viz.engine.probe import plan_for
from pergrad_viz.engine.volatile import forget
from pergrad_viz.errors import USE_AUTO, PlanMismatchError, UnsupportedModelError
from pergrad_viz.rules import Captured, capture_for, rule_for


@dataclass
class Layer:
    """A module that handles some trainable parameters, and how."""

    module: nn.Module
    plan: LayerPlan

    @property
    def local(self) -> dict[str, str]:
        return self.plan.local

    @property
    def kind(self) -> LayerKind:
        return self.plan.kind

    @property
    def rule(self):
        return rule_for(self.module) if self.kind is LayerKind.RULE else None


@dataclass
class Call:
    """One call of a layer: its inputs (args, kwargs) detached, and its output tensors (graph-connected)."""

    layer: Layer
    inputs: tuple[tuple, dict]
    input_tensors: list[torch.Tensor]  # the tensors of ``inputs``, in order
    outputs: list[torch.Tensor]
    spec: CallSpec
    versions: tuple[int, ...] = ()
    captured: Captured | None = None  # what the layer's capturing forward kept (see pergrad_viz.rules)
    key: tuple = ()  # (layer name, call index): with a tensor's position, what Plan.copy_captures names
    input_nodes: tuple = ()  # the graph nodes of its tensor arguments as called (grad_fns; None for a leaf)

    @property
    def internals(self) -> list[torch.Tensor]:
        """Tensors inside the layer whose gradients its call rule needs (graph-connected), after the outputs."""
        return [] if self.captured is None else self.captured.internals

    @property
    def activation(self) -> torch.Tensor:
        """The first tensor argument with the samples first (B, ...): what a single-tensor rule sees (a
        position-wise layer may hold them on another dimension, see ``pergrad_viz.rules``)."""
        a, dim = self.input_tensors[0], self.spec.in_dims[0]
        return a if not dim else a.movedim(dim, 0)

    def rule_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The output's gradient (N, *output.shape) with the samples first, (N, B, ...): a single-tensor rule's."""
        dim = self.spec.out_dims[0]
        return grad if not dim else grad.movedim(dim + 1, 1)

    def sample_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """:meth:`rule_grad` of one gradient without its N dimension: (*output.shape) as (B, ...)."""
        dim = self.spec.out_dims[0]
        return grad if not dim else grad.movedim(dim, 0)

    def tensors(self) -> list[torch.Tensor]:
        return self.input_tensors + self.outputs

    def changed(self) -> list[int]:  # the positions in tensors() modified in place since the call
        return [k for k, (t, v) in enumerate(zip(self.tensors(), self.versions, strict=True)) if t._version != v]


# Shape-only stand-ins, read only: per (shape, dtype, device) one expanded 0-dim zero, made once (an expand a layer
# output each call cost ~4 us of the ~150 us a layer's book-keeping took on 2 cores); cleared when it grows large.
_STAND_INS: dict[tuple, torch.Tensor] = {}
_STAND_IN_LIMIT = 1024


def shape_only(t: torch.Tensor) -> torch.Tensor:
    """A tensor of ``t``'s shape, dtype and device that holds no memory (what a rule reads of an output after the
    backward: its shape): a shared 0-dim zero, expanded, the same object for every output of that shape."""
    key = (t.shape, t.dtype, t.device)
    stand_in = _STAND_INS.get(key)
    if stand_in is None:
        if len(_STAND_INS) >= _STAND_IN_LIMIT:
            _STAND_INS.clear()
        with torch.inference_mode(False):
            stand_in = _STAND_INS[key] = torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
    return stand_in


def _layers(trainable: Trainable, plan: Plan) -> dict[str, Layer]:
    modules = dict(trainable.modules)
    return {name: Layer(modules[name], lp) for name, lp in plan.layers.items()}


def _problem(trainable: Trainable, inputs: Batch) -> str | None:
    plan = plan_for(trainable, inputs)
    return plan.interaction if plan.interaction is not None else plan.hooks_problem


def check_supported(trainable: Trainable, inputs: Batch | None = None) -> None:
    """Raise :class:`UnsupportedModelError` when the hooks strategy cannot give the per-sample definition for
    ``trainable`` on inputs like ``inputs`` (B, ...); without inputs nothing is probed (every layer is covered by
    a rule or the per-layer fallback)."""
    if inputs is not None and (problem := _problem(trainable, inputs)) is not None:
        raise UnsupportedModelError(
            f"the hooks strategy cannot be used here: {problem}. Use strategy='auto', which computes each sample "
            "alone (strategy='torch_func', or the loop where torch.func cannot run the model)."
        )


def describe(trainable: Trainable, inputs: Batch) -> dict[str, str]:
    """{layer name: 'rule' | 'call' | 'fallback'}: how each layer's per-sample gradients are computed."""
    return {name: lp.kind.value for name, lp in plan_for(trainable, inputs).layers.items()}


def _call_signature(args: tuple, kwargs: dict) -> tuple:
    """What selects a layer's code path: each argument's kind (a tensor's dtype and rank, None, a flag's value)."""

    def kind(v: object) -> object:
        if isinstance(v, torch.Tensor):
            return (v.dtype, v.dim())
        return v if isinstance(v, (bool, int, float, str, type(None))) else type(v)

    return tuple(map(kind, args)), tuple((k, kind(v)) for k, v in sorted(kwargs.items()))


def _capturing_forward(layer: Layer, capture, pending: list[Captured | None]):
    """The layer's forward as its call rule needs it run (``capture``, from ``capture_for``); each call leaves what
    it kept (or None) in ``pending`` for the forward hook. Once per plan and kind of call (masks, flags), its
    outputs are checked against the layer's own forward; if they differ, the layer takes the per-layer fallback
    from then on."""
    module = layer.module
    own = type(module).forward

    def forward(*args, **kwargs):
        result = capture(module, args, kwargs) if layer.kind is LayerKind.CALL else None
        signature = _call_signature(args, kwargs) if result is not None else None
        if result is not None and signature not in layer.plan.captures_checked:
            want = own(module, *args, **kwargs)  # with grad, as in this pass (no_grad may take a fast path)
            same = outputs_close(result[0], want)
            layer.plan.check_capture(signature, same)
            if not same:
                result = None
        if result is None:
            pending.append(None)
            return own(module, *args, **kwargs)
        pending.append(result[1])
        return result[0]

    return forward


class _Recorder:
    """One hooked forward pass's record: every call of a hooked layer, checked against the plan as it happens."""

    def __init__(self, trainable: Trainable, layers: dict[str, Layer], batch: int, copy: bool | frozenset,
                 noting: bool = True):
        self.trainable, self.layers, self.batch, self.copy = trainable, layers, batch, copy  # copy: what is copied
        self.noting = noting  # the arguments noted as each call begins (a plan's first pass), else read after it
        self.calls: list[Call] = []
        self.counts: Counter[str] = Counter()
        self.names = {id(layer.module): name for name, layer in layers.items()}
        self.pending: dict[int, list[Captured | None]] = {}  # per capturing layer, what its forward kept
        self.before_hooks: dict[int, list[tuple]] = {}  # per layer with pre-hooks: its arguments before them
        self.nodes: dict[int, list[tuple]] = {}  # per layer, its arguments' graph nodes as the call began

    def copies(self, key: tuple) -> bool:
        return self.copy is True or (self.copy is not False and key in self.copy)

    def detach(self, t: object, copy: bool) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().clone() if copy else t.detach()

    def hook(self, module: nn.Module, args: tuple, kwargs: dict, output: object) -> object:
        if not torch.is_grad_enabled() and in_reentrant_checkpoint():  # no trace in the graph on a no-grad input
            raise UnsupportedModelError(REENTRANT_CHECKPOINT)
        name = self.names[id(module)]
        layer = self.layers[name]
        if id(module) in self.before_hooks:  # the call's arguments as given, before the layer's own pre-hooks
            args, kwargs = self.before_hooks[id(module)].pop()
        if layer.plan.spread:  # a call that holds no samples: its input and output (1, ...) as (B, ...) copies
            args, kwargs = tree_map(lambda t: t.expand(self.batch, *t.shape[1:]) if isinstance(t, torch.Tensor)
                                    else t, (args, kwargs))
            output = broadcast.spread(output, self.batch, keep_graph=any(t.requires_grad for t in tensors_of(args)))
        ins = tensors_of(args) if not kwargs else tensors_of((args, kwargs))
        key = (name, self.counts[name])
        handed, outputs = _handed_downstream(output, lambda k: self.copies((*key, len(ins) + k)))
        spec = check_call(layer.plan, module, name, key[1], ins, outputs, self.batch)
        self.counts[name] += 1
        if not kwargs and len(ins) == len(args):  # the common case: tensors only, positional
            saved_ins = [self.detach(t, self.copies((*key, k))) for k, t in enumerate(ins)]
            saved = (tuple(saved_ins), {})
        else:
            whole = any(self.copies((*key, k)) for k in range(len(ins)))
            saved = tree_map(lambda t: self.detach(t, whole), (args, kwargs))
            saved_ins = tensors_of(saved)
        captured = self.pending[id(module)].pop() if id(module) in self.pending else None
        nodes = (_unchanged_arguments(module, name, *self.nodes[id(module)].pop(), self.trainable) if self.noting
                 else tuple(t.grad_fn for t in ins))
        call = Call(layer, saved, saved_ins, outputs, spec, captured=captured, key=key, input_nodes=nodes)
        call.versions = tuple(t._version for t in call.tensors())
        self.calls.append(call)
        return handed

    def remember_arguments(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.before_hooks[id(module)].append((args, kwargs))

    def note_nodes(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """The call's tensor arguments, their versions and graph nodes before its forward (and its own pre-hooks)
        ran: where the graph between the layers goes on (``engine.unplanned``)."""
        tensors = tensors_of(args) if not kwargs else tensors_of((args, kwargs))
        self.nodes[id(module)].append((tensors, [t._version for t in tensors], tuple(t.grad_fn for t in tensors)))

    def install(self, hooked: list[Layer]) -> list:
        """Forward hooks on ``hooked``, pre-hooks noting the arguments as each call begins (``noting``), and their
        arguments where a layer has pre-hooks of its own; their handles."""
        handles = [layer.module.register_forward_hook(self.hook, with_kwargs=True) for layer in hooked]
        for layer in hooked if self.noting else ():
            self.nodes[id(layer.module)] = []
            handles.append(layer.module.register_forward_pre_hook(self.note_nodes, with_kwargs=True, prepend=True))
        for layer in hooked:
            if layer.module._forward_pre_hooks:  # the per-layer fallback replays the call, pre-hooks included
                self.before_hooks[id(layer.module)] = []
                handles.append(layer.module.register_forward_pre_hook(self.remember_arguments, with_kwargs=True,
                                                                      prepend=True))
        return handles

    def finish(self, spread: dict[str, Layer], made: dict[str, dict[str, torch.Tensor]]) -> list[Call]:
        """The calls, once every layer was called as often as in the probe; broadcast layers' copies last."""
        for name, layer in self.layers.items():  # never called too: a branch the data decides (the whole batch's)
            if self.counts[name] < len(layer.plan.calls) and layer.kind is not LayerKind.BROADCAST:
                raise mismatch(layer.module, name,
                               f"is called {self.counts[name]} time(s), not {len(layer.plan.calls)},")
        for name, layer in spread.items():
            copied = list(made[name].values())
            spec = CallSpec((), (), (0,) * len(copied), tuple(tuple(e.shape[1:]) for e in copied))
            self.calls.append(Call(layer, ((), {}), [], copied, spec, versions=tuple(e._version for e in copied)))
        return self.calls


def _unchanged_arguments(module: nn.Module, name: str, tensors: list[torch.Tensor], versions: list[int],
                         nodes: tuple, trainable: Trainable) -> tuple:
    """``nodes``, the graph nodes of a call's arguments as it began. Where the layer's forward changed one of them in
    place, what was captured (after the call) is what it computed from only where the change came before the use
    (``x = relu_(x)`` at its top), not after it (``return x.add_(self.bias)``): the per-call check decides on this
    call where it runs; unchecked (``verify=False``), :class:`PlanMismatchError`."""
    for t, version in zip(tensors, versions, strict=True):
        if t._version == version or (_CHANGED, name) in trainable.call.graphs | trainable.call.plan.graphs:
            continue
        reason = (f"layer '{name}' ({type(module).__name__}) changes a tensor it was called with in place "
                  "(`x.add_(self.bias)`, `x += ...` in its forward), and unchecked, the hooks strategy cannot tell "
                  "whether what it captured of the call is what the layer computed from (compute on a copy there: "
                  "`x = x + ...`, or keep the per-call check on: verify=True)")
        if not trainable.call.checked:
            raise _ArgumentChangedInPlace(reason)
        trainable.call.graphs.add((_CHANGED, name))  # not seen by a passed check: this call is checked
    return nodes


_CHANGED = "changed in place"  # with the layer's name: what a pass where it changed an argument adds to call.graphs


def _changed(graphs: set) -> bool:
    """Whether ``graphs`` (a call's or a plan's) hold a layer's change of its argument (:data:`_CHANGED`)."""
    return any(type(g) is tuple and g[0] == _CHANGED for g in graphs)


class _ArgumentChangedInPlace(PlanMismatchError):
    """A layer changed a tensor it was called with in place, on an unchecked call: the hooks strategy is refused."""

    def __init__(self, reason: str):
        super().__init__(f"{reason}. {USE_AUTO}", reason)


def _forward(trainable: Trainable, inputs: Batch, layers: dict[str, Layer], copy: bool | frozenset,
             noting: bool = True) -> tuple[torch.Tensor, list[Call]]:
    batch = inputs.size
    record = _Recorder(trainable, layers, batch, copy, noting)
    # Layers whose call rule runs a forward of its own: an instance attribute for the duration of this pass.
    captures = {name: capture_for(layer.module) for name, layer in layers.items() if layer.kind is LayerKind.CALL}
    patched = [(layers[name], capture) for name, capture in captures.items() if capture is not None]
    # Layers whose parameters are broadcast over the batch: per-sample copies in this pass (engine.broadcast).
    spread = {name: layer for name, layer in layers.items() if layer.kind is LayerKind.BROADCAST}
    made = {name: broadcast.copies({ln: layer.module.get_parameter(ln) for ln in layer.local}, batch)
            for name, layer in spread.items()}
    handles = record.install([layer for layer in layers.values() if layer.kind is not LayerKind.BROADCAST])
    try:
        for layer, capture in patched:
            record.pending[id(layer.module)] = []
            layer.module.forward = _capturing_forward(layer, capture, record.pending[id(layer.module)])
        with broadcast.substituted({name: layer.module for name, layer in spread.items()}, made):
            output = inputs(trainable.model)
    finally:
        for layer, _ in patched:
            layer.module.__dict__.pop("forward", None)
        for h in handles:
            h.remove()
    return output, record.finish(spread, made)


_SHALLOW = (torch.Tensor, nn.Parameter, *PLAIN_LEAVES)  # what a flat output tuple may hold


def _handed_downstream(output: object, copy: Callable[[int], bool]) -> tuple[object, list[torch.Tensor]]:
    """What the layer hands downstream instead of ``output``, and the tensors whose gradients are its call's output
    gradients: for each output tensor that requires grad, a new alias of it (``copy(k)``: then a clone of it goes
    downstream, which in-place operations cannot change). The gradient at the alias holds only what flows back from
    downstream, never a path inside the layer from one output to another (an LSTMCell's ``h = o * tanh(c)``), which
    the layer's own backward counts once more."""
    if isinstance(output, torch.Tensor):
        if not output.requires_grad:
            return (output.clone() if copy(0) else output), [output]
        alias = output.view_as(output)
        return (alias.clone() if copy(0) else alias), [alias]
    aliases: list[torch.Tensor] = []

    def hand(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        alias = t.view_as(t) if t.requires_grad else t
        aliases.append(alias)
        return alias.clone() if copy(len(aliases) - 1) else alias

    if type(output) in (tuple, list) and all(type(t) in _SHALLOW for t in output):  # (out, None): no pytree
        handed = type(output)(map(hand, output))
    else:
        handed = from_pytree(tree_map(hand, as_pytree(output)))
    if len(aliases) != len(tensors_of(output)):  # a container pytree cannot rebuild: leave the output as it is
        return None, tensors_of(output)
    return handed, aliases


def capture(trainable: Trainable, inputs: Batch) -> tuple[torch.Tensor, list[Call]]:
    """One forward pass of ``inputs`` (B, ...) with every layer's calls captured (and checked against the plan)."""
    plan = plan_for(trainable, inputs)
    if plan.interaction is not None or plan.hooks_problem is not None:
        check_supported(trainable, inputs)
    layers = trainable.call.layers
    if layers is None:
        layers = trainable.call.layers = _layers(trainable, plan)
    draws = trainable.call.draws  # randomness='different': the state its draws start from, for the check
    state = None if draws is None else draws.mark(inputs.size)
    noting = not plan.arguments_kept  # the plan's first pass notes each call's arguments as it begins
    if noting and plan.changed_in_place is not None and not trainable.call.checked and not _changed(plan.graphs):
        raise _ArgumentChangedInPlace(plan.changed_in_place)  # refused before the forward
    try:
        output, calls = _forward(trainable, inputs, layers, copy=plan.copy_captures, noting=noting)
    except PlanMismatchError as e:  # another structure: a number left out of the plan's key counts again (volatile)
        forget(trainable.model)
        if isinstance(e, _ArgumentChangedInPlace):  # so for every unchecked call of this plan, until a check passes
            plan.changed_in_place = e.reason
        raise
    for every in (False, True):  # ReLU(inplace=True), `out += x`: copy what was changed, else every tensor
        changed = frozenset((*c.key, k) for c in calls for k in c.changed()) if plan.copy_captures is not True else ()
        if not changed:
            break
        plan.copy_captured_tensors(True if every else changed | (plan.copy_captures or frozenset()))  # from now on
        if state is not None:
            draws.again(state)  # the next forward draws what the first did
        output, calls = _forward(trainable, inputs, layers, copy=plan.copy_captures, noting=noting)
    if noting and not _changed(trainable.call.graphs):
        plan.arguments_kept = True  # no layer changed a tensor it was called with: later passes read them after calls
    return output, calls
