"""Per-layer rules for the ``hooks`` strategy, registered by module type.

A rule turns what one call of a layer saw into the per-sample gradients of that layer's parameters.
Two kinds, each registered by its own decorator:

``@register(*types)`` for layers with one input and one output tensor, both with the samples first::

    rule(module, activation, grad_output, out) -> None

* ``activation``: the layer's input, (B, ...), detached;
* ``grad_output``: gradients with respect to the layer's output, (N, B, *output.shape[1:]); N = 1 for
  per-sample loss gradients, N = Y for output Jacobians (one row per one-hot output vector);
* ``out``: ``{local parameter name: Tensor (N, B, *param.shape)}`` for the trainable parameters only;
  the rule overwrites them (they may be strided views into the caller's result).

``@register_call(*types)`` for layers with several inputs or outputs (e.g. ``nn.LSTM`` returning
``(output, (h_n, c_n))``)::

    call_rule(module, inputs, grad_outputs, out) -> None

* ``inputs``: the positional arguments of the call, detached (tensors keep their own layout, e.g. an
  LSTM's ``hx`` is (layers, B, H));
* ``grad_outputs``: one entry per tensor in ``torch.utils._pytree.tree_leaves(output)``, each
  (N, *leaf.shape) (so the batch dimension of a leaf moves one to the right), or None where that output
  does not reach the loss;
* ``out``: as above.

Rules are small pure functions: no state, no hooks of their own. Layers that own trainable parameters but
have no rule go through the per-layer fallback (``pergrad_viz.rules.fallback``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], None]
CallRule = Callable[[nn.Module, tuple, list, dict[str, torch.Tensor]], None]

_RULES: dict[type[nn.Module], Rule] = {}
_CALL_RULES: dict[type[nn.Module], CallRule] = {}


def register(*module_types: type[nn.Module]) -> Callable[[Rule], Rule]:
    """Decorator: use the decorated rule for these module types (and subclasses that keep their forward)."""

    def deco(rule: Rule) -> Rule:
        for t in module_types:
            _RULES[t] = rule
        return rule

    return deco


def register_call(*module_types: type[nn.Module]) -> Callable[[CallRule], CallRule]:
    """Decorator: use the decorated call rule (several inputs / outputs) for these module types."""

    def deco(rule: CallRule) -> CallRule:
        for t in module_types:
            _CALL_RULES[t] = rule
        return rule

    return deco


def _lookup(registry: dict, module: nn.Module):
    for base in type(module).__mro__:
        if base in registry:
            return registry[base] if type(module).forward is base.forward else None
    return None


def rule_for(module: nn.Module) -> Rule | None:
    """The single-tensor rule for ``module``, or None. A subclass that overrides ``forward`` gets no rule."""
    return _lookup(_RULES, module)


def call_rule_for(module: nn.Module) -> CallRule | None:
    """The call rule (several inputs / outputs) for ``module``, or None."""
    return _lookup(_CALL_RULES, module)


def supported_types() -> tuple[str, ...]:
    """Names of the module types that have a closed-form rule."""
    return tuple(sorted({t.__name__ for t in (*_RULES, *_CALL_RULES)}))


from . import activations, conv, embedding, linear, normalization, recurrent  # noqa: E402,F401  (registers the rules)
