"""What a batched fast path may assume about a model, found by running it on a few samples.

Every strategy that evaluates the model once on the whole batch (``hooks``, ``autograd_stack``, ``batched_grad``)
is only right when the samples do not interact: row i of every layer's input and output inside the batch equals
what that layer sees when sample i runs alone. The ``hooks`` strategy needs more: it must know, for each layer that
owns trainable parameters, along which dimension each of the layer's inputs and outputs holds the samples, and
which layer's forward contains every use of each parameter. Nothing of this is assumed; it is measured on a probe:

* sample a alone (twice: outputs that differ for the same inputs are a random forward, refused), sample b alone
  (two *different* samples when there are any), and the pair as a batch of two in both orders (a reordering of the
  rows by their data shows in one), each a forward with every module hooked, under a forked RNG;
* a tensor's *batch dimension* is the one dimension whose size is 1 alone and 2 in the pair (all others equal); a
  tensor with no such dimension is *shared* (e.g. a positional embedding of ``arange(T)``); a tensor that changes
  any other way (e.g. (B*T, d) rows) is not per-sample;
* rows of the pair are compared with the runs alone (values, with a tolerance per feature: a small difference next
  to one very large feature is seen), and shared tensors must not change with the samples (a batch mean has the
  shape of a shared tensor but not its values);
* a ``TorchFunctionMode`` notes the stack of running modules at every use of a trainable parameter; what a
  Jacobian's ``output=`` selects is compared the same way (``pergrad_viz.engine.selection``).

Two batch sizes mean that no coincidence of sizes (T == B, layers == B) can pass for a batch dimension. The result,
a :class:`Plan`, is cached per model and keyed by what can change it structurally (``engine.plan_key``: the input's
shape past the batch, every module's identity, forward, hooks and plain attributes, every parameter, ``output=``).
Each real call re-checks the shapes it captured against the plan, which is cheap; what no structural key can see
(values that switch a branch, a coupling a pair does not show) is left to the per-call check (``engine.certify``).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn.modules import module as module_mod

from pergrad_viz.core.batch import Batch, differs
from pergrad_viz.core.float64 import below_float64, float64_copy, to_float64
from pergrad_viz.core.guards import refusing_reentrant_checkpoints
from pergrad_viz.core.ownership import assign
from pergrad_viz.core.randomness import held_fixed, random_fix
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.core.validate import refuse_written_inputs
from pergrad_viz.engine import broadcast
from pergrad_viz.engine.observe import close, first_difference, forked_random, observe
from pergrad_viz.engine.plan import SHARED, CallSpec, LayerKind, LayerPlan, Plan, Unbatched
from pergrad_viz.engine.plan_key import plan_key
from pergrad_viz.engine.selection import selection_interaction
from pergrad_viz.engine.volatile import differs_in_numbers, note_probe
from pergrad_viz.errors import UndefinedPerSampleError
from pergrad_viz.rules import call_rule_for, rule_for, rule_takes_batch_dim


def _batch_dim(alone: torch.Size, pair: torch.Size) -> int | None | Unbatched:
    """The dimension that is 1 alone and 2 in the pair; SHARED if the shapes are equal; NOT_PER_SAMPLE otherwise."""
    if alone == pair:
        return SHARED
    if len(alone) != len(pair):
        return Unbatched.NOT_PER_SAMPLE
    diff = [d for d, (a, p) in enumerate(zip(alone, pair, strict=True)) if a != p]
    if len(diff) == 1 and alone[diff[0]] == 1 and pair[diff[0]] == 2:
        return diff[0]
    return Unbatched.NOT_PER_SAMPLE


def _pick_pair(inputs: Batch) -> tuple[int, int, bool]:
    """Two samples of the call (two different ones where there are), and whether they differ."""
    other = next((j for j in range(1, inputs.size) if differs(inputs, 0, j)), None)
    return (0, other, True) if other is not None else (0, 0, False)


def _describe(leaf: str, name: str, module: nn.Module) -> str:
    return f"{leaf} of layer '{name or 'model'}' ({type(module).__name__})"


class _Probe:
    def __init__(self, trainable: Trainable, inputs: Batch):
        self.trainable = trainable
        self.modules = dict(trainable.modules)
        a, b, self.verified = _pick_pair(inputs)
        self.index = index = torch.tensor([a, b], device=inputs.device)
        watch = {id(p): n for n, p in zip(trainable.names, trainable.params, strict=True)}
        device = trainable.device
        # each run on copies: a forward that writes its input in place is refused before it writes the caller's
        runs = [inputs.sample(a), inputs.sample(a), inputs.sample(b), inputs.rows(index), inputs.rows(index.flip(0))]
        runs = [run.map(torch.clone) for run in runs]
        versions = [v for run in runs for v in run.versions()]
        with forked_random(device):  # the caller's random state untouched
            self.alone_a, drew = observe(trainable, runs[0], None, random_ops=True)
            again, _ = observe(trainable, runs[1], None)
            self.alone_b, _ = observe(trainable, runs[2], None)
            self.pair, self.uses = observe(trainable, runs[3], watch)
            self.swapped, _ = observe(trainable, runs[4], None)  # a reordering by the data shows
        refuse_written_inputs(versions, copies=True)
        self.random = drew if drew is not None else first_difference(self.alone_a, again)
        self.specs: dict[str, list[CallSpec] | str] = {}
        self.interaction: str | None = None
        self.interaction = selection_interaction(self)  # a Jacobian's output=, where the call has one

    def spec(self, name: str) -> list[CallSpec] | str:
        """The call specs of module ``name``, or why its tensors are not per-sample; notes interactions."""
        if name in self.specs:
            return self.specs[name]
        module = self.modules[name]
        pair = self.pair.calls.get(name, [])
        swapped = self.swapped.calls.get(name, [])
        alone = [self.alone_a.calls.get(name, []), self.alone_b.calls.get(name, [])]
        result: list[CallSpec] | str
        if len(alone[0]) != len(pair) or len(alone[1]) != len(pair) or len(swapped) != len(pair):
            result = (f"layer '{name or 'model'}' ({type(module).__name__}) is called {len(alone[0])} and "
                      f"{len(alone[1])} time(s) for two samples alone but {len(pair)} and {len(swapped)} time(s) for "
                      "the two together (in either order): its calls depend on the data")
            self.interaction = self.interaction or result
        else:
            result = []
            for k, (ins, outs) in enumerate(pair):
                spec = self.call_spec(name, module, (ins, outs), swapped[k], [a[k] for a in alone])
                if isinstance(spec, str):
                    result = spec
                    break
                result.append(spec)
        self.specs[name] = result
        return result

    def call_spec(self, name, module, pair, swapped, alone) -> CallSpec | str:
        dims: list[list[int | None]] = [[], []]
        rests: list[list[tuple[int, ...]]] = [[], []]
        for side, what in enumerate(("an input", "an output")):
            leaves, swapped_leaves = pair[side], swapped[side]
            alone_leaves = [a[side] for a in alone]
            if any(len(a) != len(leaves) for a in (*alone_leaves, swapped_leaves)):
                return f"{_describe(what, name, module)} changes structure with the batch size"
            for k, leaf in enumerate(leaves):
                single = [a[k] for a in alone_leaves]
                dim = _batch_dim(single[0].shape, leaf.shape)
                if (dim is Unbatched.NOT_PER_SAMPLE or single[1].shape != single[0].shape
                        or swapped_leaves[k].shape != leaf.shape):
                    if single[0].dim() < leaf.dim():
                        return (f"{_describe(what, name, module)} has shape {tuple(single[0].shape)} for one sample "
                                f"and {tuple(leaf.shape)} for two: it loses a dimension for a batch of one (e.g. "
                                ".squeeze() without a dimension; use .squeeze(-1) or .flatten(1))")
                    other = f", {tuple(single[1].shape)} for another" if single[1].shape != single[0].shape else ""
                    return (f"{_describe(what, name, module)} has shape {tuple(single[0].shape)} for one sample{other} "
                            f"and {tuple(leaf.shape)} for two: the samples are not along one dimension of it (e.g. "
                            "(B*T, ...) rows after a reshape, or rows the data selects, such as x[mask])")
                if dim is SHARED:
                    if not all(close(t, single[0]) for t in (leaf, single[1], swapped_leaves[k])):
                        self.interaction = self.interaction or (
                            f"{_describe(what, name, module)} has no batch dimension but its values depend on the "
                            "samples (e.g. a mean over the batch)" + (_OWN_LOSS if leaf.dim() == 0 and side else ""))
                    rests[side].append(tuple(leaf.shape))
                else:
                    scale = _feature_scale(single)
                    for row in (0, 1):
                        if not (close(leaf.narrow(dim, row, 1), single[row], scale)
                                and close(swapped_leaves[k].narrow(dim, 1 - row, 1), single[row], scale)):
                            self.interaction = self.interaction or (
                                f"{_describe(what, name, module)} differs for a sample inside a batch and alone: "
                                "the samples interact (e.g. statistics over the batch)")
                    rests[side].append(tuple(s for d, s in enumerate(leaf.shape) if d != dim))
                dims[side].append(dim)
        return CallSpec(tuple(dims[0]), tuple(rests[0]), tuple(dims[1]), tuple(rests[1]))


def _feature_scale(single: list[torch.Tensor]) -> torch.Tensor | None:
    """The magnitude of each feature over the samples run alone (elementwise), for ``observe.close``."""
    if not single[0].is_floating_point() or single[0].shape != single[1].shape:
        return None
    return torch.maximum(single[0].abs(), single[1].abs())


def _why_not(probe: _Probe, modules: dict[str, nn.Module]):
    """``why_not(name)``: why module ``name`` cannot handle parameters (tensors not per-sample, a shared output)."""

    def why_not(name: str) -> str | None:
        spec = probe.spec(name)
        if isinstance(spec, str):
            return spec
        if any(d is SHARED for s in spec for d in s.out_dims):
            m = modules[name]
            if any(0 in rest for s in spec for rest in (*s.in_rest, *s.out_rest)):
                return (f"layer '{name or 'model'}' ({type(m).__name__}) gets no rows of the batch here (an empty "
                        "selection, such as x[mask] where no sample qualifies), so which sample its gradient belongs "
                        "to cannot be seen")
            return (f"layer '{name or 'model'}' ({type(m).__name__}) gives an output with no batch dimension (the same "
                    "for every sample, e.g. a positional embedding of arange(T) broadcast over the batch), so its "
                    "gradient cannot be split by sample there")
        return None

    return why_not


def _user_hooks(module: nn.Module) -> int:
    """Forward (pre-)hooks that may change what a layer sees or gives: a closed-form rule would not know them."""
    return (len(module._forward_hooks) + len(module._forward_pre_hooks)
            + len(module_mod._global_forward_hooks) + len(module_mod._global_forward_pre_hooks))


def _kind(module: nn.Module, local: dict[str, str], specs: list[CallSpec]) -> LayerKind:
    if _user_hooks(module):  # a hook may change what the layer sees or gives: only the layer itself knows
        return LayerKind.FALLBACK
    own = all("." not in ln for ln in local)  # the module's own parameters (a call rule may also cover children's)
    if own and rule_for(module) is not None and all(
            len(s.in_dims) >= 1 and rule_takes_batch_dim(module, s.in_dims[0], len(s.in_rest[0]) + 1)
            and all(d is SHARED for d in s.in_dims[1:]) and s.out_dims == (s.in_dims[0],) for s in specs):
        return LayerKind.RULE
    # a call rule reads the layer's weights as tensors: one computed by a parametrization (its own parameters
    # trainable: W + A @ B) leaves the parametrization's parameters to the fallback
    if call_rule_for(module) is not None and not any("parametrizations" in ln.split(".") for ln in local):
        batch_dim = 0 if getattr(module, "batch_first", False) else 1  # (B, T, in) or (T, B, in)
        if all(s.in_dims[:1] == (batch_dim,) and s.out_dims[:1] == (batch_dim,) and len(s.in_rest[0]) == 2
               for s in specs):
            return LayerKind.CALL
    return LayerKind.FALLBACK


def _make_plan(trainable: Trainable, inputs: Batch) -> Plan:
    with restoring_modes(trainable, keep_parameters=True):  # the probe runs the model: all left as it was
        probe = _Probe(trainable, inputs)
    if probe.random is not None and trainable.call.draws is None:  # randomness='different': held fixed here
        module = dict(trainable.modules)[probe.random]
        raise UndefinedPerSampleError(
            f"{_describe('the forward', probe.random, module)} draws random numbers (torch's, numpy's: dropout as "
            "F.dropout(..., training=True), stochastic depth, noise, masks) or differs for one sample in two runs, "
            f"so per-sample gradients would be random and not comparable. {random_fix(trainable)}. (Or it "
            "keeps a state from one call to the next, self.h = h.detach(): each sample's gradient would depend on "
            "the samples before it; pass that state as an input instead.)")
    for name, _m in trainable.modules:  # every module's tensors are compared: samples interacting anywhere are found
        probe.spec(name)
    if probe.interaction is not None and below_float64(trainable.dtype):
        probe.interaction = _in_float64(trainable, inputs, probe.interaction)
    # Handlers keep the samples apart (checked by why_not), or hand a shared output downstream as per-sample copies.
    handlers, hooks_problem, spread = _assign_spreading(trainable, inputs, probe)
    if probe.pair.differentiates and hooks_problem is None:
        hooks_problem = ("the forward differentiates inside itself (torch.autograd.grad with create_graph=True, as a "
                         "force field or a physics-informed network does): the parameters' uses in that graph lie "
                         "in no layer's forward, and the per-layer rules would miss them")
    if module_mod._global_forward_pre_hooks and hooks_problem is None:
        hooks_problem = ("a global forward pre-hook (register_module_forward_pre_hook) changes what every layer sees, "
                         "and a layer's replay on the per-layer fallback would apply it a second time")
    layers: dict[str, LayerPlan] = {}
    if hooks_problem is None:
        for name, module in trainable.modules:
            if name in handlers:
                specs = probe.spec(name)
                if name in spread:  # the samples first, as the per-sample copies will hold them
                    specs = [CallSpec((0,), (s.in_rest[0][1:],), (0,), (s.out_rest[0][1:],)) for s in specs]
                layers[name] = LayerPlan(name, _kind(module, handlers[name], specs), handlers[name], specs,
                                         spread=name in spread)
    if hooks_problem is None and probe.interaction is None:
        _broadcast(trainable, inputs, probe.index, layers)
    root = probe.spec("")
    if isinstance(root, str):
        probe.interaction = probe.interaction or root
    elif probe.interaction is None and root and any(d != 0 for d in root[0].out_dims):
        d = next(d for d in root[0].out_dims if d != 0)
        where = "no batch dimension" if d is SHARED else f"the samples along dimension {d}"
        probe.interaction = (f"the model's output has a tensor with {where}, not 0: a batched output cannot be "
                             "split into per-sample losses or outputs by its first dimension")
    return Plan(layers, probe.interaction, hooks_problem, probe.verified,
                lower_precision=_lower_precision(trainable, probe.pair))


def _lower_precision(trainable: Trainable, record) -> str | None:
    """Where a module called under ``torch.autocast`` (inside the forward) gives an output in a floating dtype of less
    precision than the parameters': a phrase naming the first, else None. A batched forward rounds there otherwise
    than each sample alone, by more than the parameters' dtype's tolerance. (A float32 mask in a float64 model, a
    frozen bfloat16 part without autocast: computed as the model says, not refused.)"""
    eps = torch.finfo(trainable.dtype).eps
    for name, calls in record.calls.items():
        if name not in record.autocast:
            continue
        for _, outputs in calls:
            low = next((t.dtype for t in outputs if t.is_floating_point() and torch.finfo(t.dtype).eps > eps), None)
            if low is not None:
                return f"{_describe('the output', name, trainable.model.get_submodule(name))} is {low}"
    return None


def _in_float64(trainable: Trainable, inputs: Batch, found: str) -> str | None:
    """A sample that differs inside a batch and alone below float64, settled on a float64 copy: ``found`` where the
    copy's probe sees it too (or no copy runs), None where not (rounding: on CUDA a batch and a sample alone take
    different kernels, in TF32 by default for convolutions; ResNet-18's layer3 on an H200 was 2% apart)."""
    copied = float64_copy(trainable)
    if copied is None:
        return found
    try:
        with restoring_modes(copied):
            again = _Probe(copied, inputs.map(to_float64))
            for name, _m in copied.modules:
                again.spec(name)
    except Exception:  # the model does not run in float64 (a dtype hard-coded, an assertion): as found
        return found
    return None if again.interaction is None else found


def _broadcast(trainable: Trainable, inputs: Batch, index: torch.Tensor, layers: dict[str, LayerPlan]) -> None:
    """Layers on the fallback whose parameters are all broadcast over the batch (each (1, ...)) take the
    ``BROADCAST`` path where :func:`pergrad_viz.engine.broadcast.check` finds it gives the definition on the pair."""
    found = {name: lp.local for name, lp in layers.items()
             if lp.kind is LayerKind.FALLBACK and broadcast.candidate(trainable, lp.local)}
    if not found:
        return
    with _apart(trainable):
        ok = broadcast.check(trainable, inputs, index, found)
    if ok:
        for name in found:
            layers[name].kind = LayerKind.BROADCAST


def _assign_spreading(trainable: Trainable, inputs: Batch, probe: _Probe
                      ) -> tuple[dict[str, dict[str, str]], str | None, set[str]]:
    """:func:`~pergrad_viz.core.ownership.assign` where a layer with a rule whose calls hold no samples (a position
    embedding of shared ids (1, T), its (1, T, D) output added to every sample) may handle its own parameters, its
    output handed downstream as a per-sample copy (:func:`pergrad_viz.engine.broadcast.spread`): taken where
    :func:`~pergrad_viz.engine.broadcast.check_outputs` finds that this gives the definition on the probe's pair.
    Returns (handlers, problem, the layers whose output is spread)."""
    modules = dict(trainable.modules)
    why_not = _why_not(probe, modules)

    def plain() -> tuple[dict[str, dict[str, str]], str | None, set[str]]:
        return (*assign(trainable, probe.uses, why_not), set())

    if probe.interaction is not None:  # (two equal samples still show a coupling: the cotangents differ by row)
        return plain()
    able = set()
    for name, module in trainable.modules:
        specs = probe.spec(name)
        if (not isinstance(specs, str) and specs and rule_for(module) is not None and not _user_hooks(module)
                and all(broadcast.shared_call(s.in_dims, s.in_rest, s.out_dims, s.out_rest) for s in specs)
                and rule_takes_batch_dim(module, 0, len(specs[0].in_rest[0]))):
            able.add(name)
    if not able:
        return plain()
    handlers, problem = assign(trainable, probe.uses, lambda n: None if n in able else why_not(n))
    spread = able & set(handlers)
    # A spread layer handles its own parameters only (not a descendant's, whose local names are dotted).
    if problem is not None or not spread or any("." in ln for n in spread for ln in handlers[n]):
        return plain()
    with _apart(trainable):
        ok = broadcast.check_outputs(trainable, inputs, probe.index, sorted(spread, key=list(modules).index))
    return (handlers, None, spread) if ok else plain()


@contextmanager
def _apart(trainable: Trainable) -> Iterator[None]:
    """Runs of the model for the plan: its modes restored after them, the caller's random state untouched."""
    device = trainable.device
    with restoring_modes(trainable, keep_parameters=True), forked_random(device):
        yield


_PLANS: weakref.WeakKeyDictionary[nn.Module, OrderedDict[tuple, Plan]] = weakref.WeakKeyDictionary()
PLANS_PER_MODEL = 64  # the input signatures remembered per model, the least recently used let go (a text model's
# batches padded to their longest sequence: each length its signature, its plan probed once, not at every change)


def remember(kept: OrderedDict, key: tuple, value: object) -> object:
    """``kept[key] = value`` as the most recently used, the least recently used let go past :data:`PLANS_PER_MODEL`;
    returns ``value``."""
    kept[key] = value
    kept.move_to_end(key)
    while len(kept) > PLANS_PER_MODEL:
        kept.popitem(last=False)
    return value


_OWN_LOSS = ("; a scalar output: a model given its labels computes its loss over the batch (a Hugging Face "
             "output.loss): pass the labels as targets instead, with loss_fn=pv.sequence_classification_loss or "
             "pv.causal_lm_loss, and the fast path runs (auto computes each sample alone here)")


def plan_for(trainable: Trainable, inputs: Batch | torch.Tensor) -> Plan:
    """The :class:`Plan` for ``trainable`` called on inputs like ``inputs`` (B, ...), from the cache or a probe (a
    plan found on a batch whose samples were all equal is not reused once a call has different samples)."""
    if trainable.call.plan is not None:
        return trainable.call.plan
    inputs = inputs if isinstance(inputs, Batch) else Batch.of(inputs)
    key = trainable.call.key = plan_key(trainable, inputs)
    plans = _PLANS.get(trainable.model)
    if plans is None:
        plans = _PLANS[trainable.model] = OrderedDict()
    cached = plans.get(key)
    if cached is not None and (cached.verified or inputs.size == 1):
        plan = cached
        plans.move_to_end(key)
    else:
        # the latest plan whose key differs from this one in numbers only (the same input signature, structure)
        last = next(((k, p) for k, p in reversed(plans.items()) if differs_in_numbers(k, key)), None)
        # the probe's backward passes meet a reentrant checkpoint first; randomness='different': draws held fixed
        with refusing_reentrant_checkpoints(), held_fixed(trainable.call.draws is not None):
            plan = _make_plan(trainable, inputs)
        if last is not None and note_probe(trainable.model, last, key, plan):  # a call counter: left out
            plans.clear()  # keys read with the attribute in them
            key = trainable.call.key = plan_key(trainable, inputs)
        remember(plans, key, plan)
    trainable.call.plan = plan
    return plan
