"""Forward hooks capture each layer's input and output; one backward pass gives the gradients with
respect to the layer outputs; a per-layer rule (``pergrad_viz.rules``) turns both into per-sample
parameter gradients.

For per-sample gradients the backward pass is a single ordinary one (of the summed per-sample losses).
For output Jacobians it is batched over the Y one-hot output vectors only (``is_grads_batched``), never
over B x Y: each vector selects output j of *every* sample at once, since samples do not interact.

Every layer that owns trainable parameters needs a rule, and each such parameter must be used only inside
the forward of a layer that owns it (a rule cannot see ``F.linear(h, self.emb.weight)`` in a parent's
forward); :func:`check_supported` checks both.
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..errors import UnsupportedModelError
from ..losses import LossFn, summed_per_sample_loss
from ..rules import Rule, rule_for, supported_types
from ..target import Target
from ._common import flat_outputs


@dataclass
class _Call:
    module: nn.Module
    activation: torch.Tensor
    output: torch.Tensor
    versions: tuple[int, int]

    def modified_in_place(self) -> bool:
        return (self.activation._version, self.output._version) != self.versions


def _layers(target: Target) -> dict[nn.Module, tuple[Rule | None, dict[str, str]]]:
    """Modules that own trainable parameters -> (rule, {local name: full name}); computed once per call."""
    if "hooks.layers" in target.cache:
        return target.cache["hooks.layers"]
    full_name = {id(p): n for n, p in zip(target.names, target.params, strict=True)}
    layers = {}
    for _, module in target.modules:
        local = {ln: full_name[id(p)] for ln, p in module._parameters.items() if id(p) in full_name}
        if local:
            layers[module] = (rule_for(module), local)
    target.cache["hooks.layers"] = layers
    return layers


def check_supported(target: Target, inputs: torch.Tensor | None = None) -> None:
    """Raise :class:`UnsupportedModelError` naming a layer with trainable parameters but no rule or, given
    ``inputs`` (B, ...), a trainable parameter used outside the forward of the layers that own it.

    The second check runs the model on one sample, once per model (until its layers change).
    """
    names = None
    for module, (rule, local) in _layers(target).items():
        if rule is None:
            names = {m: n for n, m in target.modules}
            raise UnsupportedModelError(
                f"the hooks strategy has no rule for layer '{names[module] or 'model'}' "
                f"({type(module).__name__}), which owns trainable parameters {sorted(local)}. "
                f"Layers with rules: {', '.join(supported_types())}. Use strategy='torch_func' (or 'auto', "
                "which picks it), or freeze those parameters with requires_grad_(False)."
            )
    if inputs is not None:
        _check_layers_on_a_probe(target, inputs[:2])


_CHECKED: weakref.WeakKeyDictionary[nn.Module, tuple] = weakref.WeakKeyDictionary()


class _ParameterWatch(TorchFunctionMode):
    """Notes every torch function that receives a watched parameter outside the layers that own it."""

    def __init__(self, owners: dict[int, tuple[str, set[nn.Module]]]):
        super().__init__()
        self.owners = owners
        self.running: list[nn.Module] = []  # the layers whose forward is executing
        self.strays: list[tuple[str, str]] = []  # (parameter, function)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            for t in value if isinstance(value, list | tuple) else (value,):
                owner = self.owners.get(id(t)) if isinstance(t, torch.Tensor) else None
                if owner is not None and (not self.running or self.running[-1] not in owner[1]):
                    self.strays.append((owner[0], getattr(func, "__name__", str(func))))
        return func(*args, **kwargs)


def _check_layers_on_a_probe(target: Target, sample: torch.Tensor) -> None:
    """Run the model on ``sample`` (one or two samples) and refuse what the rules cannot handle: a trainable
    parameter used outside its layers, or a layer whose input or output does not have the batch first."""
    layers = _layers(target)
    signature = tuple((id(m), tuple(local.values())) for m, (_rule, local) in layers.items())
    if _CHECKED.get(target.model) == signature:
        return
    params = dict(zip(target.names, target.params, strict=True))
    owners: dict[int, tuple[str, set[nn.Module]]] = {}
    for module, (_rule, local) in layers.items():
        for name in local.values():
            owners.setdefault(id(params[name]), (name, set()))[1].add(module)
    watch = _ParameterWatch(owners)
    misplaced: list[tuple[nn.Module, list]] = []
    def enter(module: nn.Module, args: tuple) -> None:
        watch.running.append(module)

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        watch.running.pop()
        first = [t.shape[0] if t.dim() else None for t in (*args[:1], output) if isinstance(t, torch.Tensor)]
        if any(n != sample.shape[0] for n in first):
            misplaced.append((module, first))

    handles = []
    for module in layers:
        handles.append(module.register_forward_pre_hook(enter))
        handles.append(module.register_forward_hook(leave, always_call=True))
    try:
        with torch.no_grad(), watch:
            target.model(sample)
    finally:
        for h in handles:
            h.remove()
    if misplaced:
        module, first = misplaced[0]
        name = next(n for n, m in target.modules if m is module) or "model"
        raise UnsupportedModelError(
            f"layer '{name}' ({type(module).__name__}) saw its input/output with first dimensions {first} for a "
            f"batch of {sample.shape[0]}: the hooks rules need the samples along the first dimension (not e.g. "
            "(T, B, ...) or (B*T, ...)). Use strategy='torch_func' (or 'auto', which picks it)."
        )
    if watch.strays:
        name, func = watch.strays[0]
        raise UnsupportedModelError(
            f"the hooks strategy cannot see parameter '{name}' being used outside the forward of its own layer "
            f"(by {func} in the model's forward, e.g. weights tied with F.linear(h, self.emb.weight)), so it "
            "would miss that part of the gradient. Use strategy='torch_func' (or 'auto', which picks it), or "
            "tie the weights by sharing the parameter between two layers (layer2.weight = layer1.weight)."
        )
    _CHECKED[target.model] = signature


def _forward(target: Target, inputs: torch.Tensor, layers: dict, copy: bool) -> tuple[torch.Tensor, list[_Call]]:
    calls: list[_Call] = []

    def hook(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> torch.Tensor | None:
        activation = (args[0] if args else next(iter(kwargs.values()))).detach()  # e.g. fc(input=x)
        if copy:
            activation = activation.clone()
        calls.append(_Call(module, activation, output, (activation._version, output._version)))
        # Hand later layers a copy, so that in-place ops downstream cannot change `output`.
        return output.clone() if copy else None

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in layers]
    try:
        output = target.model(inputs)
    finally:
        for h in handles:
            h.remove()
    return output, calls


def _capture(target: Target, inputs: torch.Tensor) -> tuple[torch.Tensor, list[_Call], dict]:
    layers = _layers(target)
    output, calls = _forward(target, inputs, layers, copy=False)
    if any(c.modified_in_place() for c in calls):  # e.g. ReLU(inplace=True) right after a Linear
        output, calls = _forward(target, inputs, layers, copy=True)
    return output, calls, layers


def _apply_rules(target: Target, calls: list[_Call], grad_outputs: tuple, layers: dict,
                 out: dict[str, torch.Tensor]) -> None:
    """``out[name]`` is (N, B, *param.shape) here; sums over repeated calls of a shared layer, and over
    modules that share (tie) a parameter."""
    uses = Counter(fn for c in calls for fn in layers[c.module][1].values())
    written: set[str] = set()
    for call, g in zip(calls, grad_outputs, strict=True):
        rule, local = layers[call.module]
        if g is None:  # this call does not reach the output
            g = torch.zeros(out[next(iter(local.values()))].shape[0], *call.output.shape,
                            dtype=call.output.dtype, device=call.output.device)
        if all(uses[fn] == 1 for fn in local.values()):
            rule(call.module, call.activation, g, {ln: out[fn] for ln, fn in local.items()})
            written.update(local.values())
            continue
        tmp = {ln: torch.empty_like(out[fn]) for ln, fn in local.items()}
        rule(call.module, call.activation, g, tmp)
        for ln, fn in local.items():
            if fn in written:
                out[fn].add_(tmp[ln])
            else:
                out[fn].copy_(tmp[ln])
                written.add(fn)
    for name in target.names:
        if name not in written:  # a layer the forward pass never called
            out[name].zero_()


def loss_gradients(target: Target, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor
                   ) -> tuple[list[_Call], dict, tuple]:
    """1 forward with hooks, 1 backward of the summed per-sample losses to the layer outputs only.

    Returns (calls, layers, grad_outputs): one (1, B, *output.shape[1:]) gradient per call (None where the
    call does not reach the loss); no gradients when no layer with trainable parameters ran.
    """
    output, calls, layers = _capture(target, inputs)
    if not calls:
        return calls, layers, ()
    total = summed_per_sample_loss(loss_fn, output, targets)
    grad_outputs = torch.autograd.grad(total, [c.output for c in calls], allow_unused=True)
    return calls, layers, tuple(None if g is None else g.unsqueeze(0) for g in grad_outputs)  # N = 1


def output_gradients(target: Target, inputs: torch.Tensor) -> tuple[list[_Call], dict, tuple, int]:
    """1 forward with hooks, 1 backward batched over the Y one-hot output vectors to the layer outputs.

    Returns (calls, layers, grad_outputs, Y): one (Y, B, *output.shape[1:]) gradient per call (or None).
    """
    output, calls, layers = _capture(target, inputs)
    outputs = flat_outputs(output)  # (B, Y)
    batch, y_count = outputs.shape
    if not calls:
        return calls, layers, (), y_count
    one_hot = torch.eye(y_count, dtype=outputs.dtype, device=outputs.device).unsqueeze(1).expand(-1, batch, -1)
    grad_outputs = torch.autograd.grad(outputs, [c.output for c in calls], grad_outputs=one_hot,
                                       is_grads_batched=True, allow_unused=True)
    return calls, layers, grad_outputs, y_count


def grads(target: Target, loss_fn: LossFn, inputs: torch.Tensor, targets: torch.Tensor,
          out: dict[str, torch.Tensor]) -> None:
    """1 forward, 1 backward (to the layer outputs only), then the rules; writes (B, *param.shape)."""
    calls, layers, grad_outputs = loss_gradients(target, loss_fn, inputs, targets)
    _apply_rules(target, calls, grad_outputs, layers, {n: t.unsqueeze(0) for n, t in out.items()})


def jacobian(target: Target, inputs: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """1 forward, 1 backward batched over the Y outputs, then the rules; writes (B, Y, *param.shape)."""
    calls, layers, grad_outputs, _ = output_gradients(target, inputs)
    _apply_rules(target, calls, grad_outputs, layers, {n: t.transpose(0, 1) for n, t in out.items()})
