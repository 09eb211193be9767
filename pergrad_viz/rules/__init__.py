"""Per-layer rules for the ``hooks`` strategy, registered by module type.

A rule turns what one call of a layer saw into the per-sample gradients of that layer's parameters::

    rule(module, activation, grad_output, out) -> None

* ``activation``: the layer's input, (B, ...), detached;
* ``grad_output``: gradients with respect to the layer's output, (N, B, *output.shape[1:]); N = 1 for
  per-sample loss gradients, N = Y for output Jacobians (one row per one-hot output vector);
* ``out``: ``{local parameter name: Tensor (N, B, *param.shape)}`` for the trainable parameters only;
  the rule overwrites them (they may be strided views into the caller's result).

Rules are small pure functions: no state, no hooks of their own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], None]

_RULES: dict[type[nn.Module], Rule] = {}


def register(*module_types: type[nn.Module]) -> Callable[[Rule], Rule]:
    """Decorator: use the decorated rule for these module types (and subclasses that keep their forward)."""

    def deco(rule: Rule) -> Rule:
        for t in module_types:
            _RULES[t] = rule
        return rule

    return deco


def rule_for(module: nn.Module) -> Rule | None:
    """The rule for ``module``, or None. A subclass that overrides ``forward`` gets no rule."""
    for base in type(module).__mro__:
        if base in _RULES:
            return _RULES[base] if type(module).forward is base.forward else None
    return None


def supported_types() -> tuple[str, ...]:
    """Names of the module types that have a rule."""
    return tuple(sorted(t.__name__ for t in _RULES))


from . import activations, conv, embedding, linear, norms  # noqa: E402,F401  (registers the rules)
