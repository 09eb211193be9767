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

``@register(*types, features=f)`` marks a *position-wise* layer: it acts alike on every position of its input's
leading dimensions, and its parameters only on the last ``f(module)`` ones (``nn.Linear``: 1, ``nn.LayerNorm``:
``len(normalized_shape)``, ``nn.Embedding``: 0). Its input may then hold the samples on any leading dimension
(e.g. a Linear on sequence-first (T, B, d) tokens, PyTorch's default layout for transformers): the rule is given
``activation`` and ``grad_output`` with the samples moved to the front, which for such a layer is the same call.

``@register_call(*types)`` for layers with several inputs or outputs (e.g. ``nn.LSTM`` returning
``(output, (h_n, c_n))``)::

    call_rule(module, inputs, grad_outputs, out) -> None

* ``inputs``: the positional arguments of the call, detached (tensors keep their own layout, e.g. an
  LSTM's ``hx`` is (layers, B, H));
* ``grad_outputs``: one entry per tensor in ``torch.utils._pytree.tree_leaves(output)``, each
  (N, *leaf.shape) (so the batch dimension of a leaf moves one to the right), or None where that output
  does not reach the loss;
* ``out``: as above.

A call rule may also register ``capture=``, a forward of its own for the layer (same outputs, up to rounding),
used instead of the layer's while the ``hooks`` strategy captures a call::

    capture(module, args, kwargs) -> (output, Captured) | None

It keeps tensors from inside the layer (e.g. MultiheadAttention's q / k / v projections) whose gradients the
one backward pass to the layer outputs then gives too, so that the rule need not replay the layer. The rule is
then called as ``call_rule(module, inputs, grad_outputs, out, captured, captured_grads)`` (``captured`` None
where the capture returned None: the rule raises NotImplementedError and the layer takes the per-layer
fallback), with ``captured_grads`` one (N, *internal.shape) gradient or None per ``captured.internals``.

``@register_ghost(*types)`` for layers whose per-sample weight gradient is a sum over the T positions they saw of
outer products (``nn.Linear``: g_t a_t^T; ``nn.Embedding``: g_t in row idx_t): a class of static methods that give
per-sample gradient norms and NTK terms from Gram matrices, never the per-sample gradient itself (see
:class:`GhostRule`).

Rules are small pure functions: no state, no hooks of their own.
A rule is used only for a module whose forward is its registered type's own (not a subclass's, not an instance
attribute, not a forward patched onto the class after import). Layers that own trainable parameters but
have no rule go through the per-layer fallback (``pergrad_viz.rules.fallback``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

Rule = Callable[[nn.Module, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], None]
CallRule = Callable[..., None]


@dataclass
class Captured:
    """What a layer's own capturing forward kept of one call: ``internals``, tensors inside the layer
    (graph-connected) whose gradients its call rule needs, and ``state``, anything else it needs (detached)."""

    internals: list[torch.Tensor]
    state: object = None


class GhostRule(Protocol):
    """Norms and kernels of a layer with per-sample weight gradient sum_t outer(g_t, a_t), from Gram matrices.

    Shapes: B samples, T positions (tokens, or repeated calls of a shared layer), N = 1 for loss gradients and
    N = Y for output Jacobians.
    """

    kind: str

    @staticmethod
    def applies(module: nn.Module) -> bool:
        """Whether this layer's configuration has the outer-product form (else its dense rule is used)."""

    @staticmethod
    def stack(module: nn.Module, seen: Sequence[tuple[torch.Tensor, torch.Tensor]]
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """All calls ``[(activation (B, ...), grad_output (N, B, ...))]`` as one call on T positions: ``(a, g)``
        with a (B, T, ...) and g (N, B, T, out) (rows the layer ignores, e.g. ``padding_idx``, zeroed)."""

    @staticmethod
    def squared_norms(module: nn.Module, a: torch.Tensor, g: torch.Tensor, local: Collection[str]
                      ) -> dict[str, torch.Tensor]:
        """{local name: (B,) squared norm of the per-sample gradient}, from ``stack``'s a and g[0] (B, T, out)."""

    @staticmethod
    def overlap(a1: torch.Tensor, a2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(N1, N2, T, S): what the weight's kernel term multiplies g_t . g_s by (a_t . a_s for Linear)."""

    @staticmethod
    def gram_cost(module: nn.Module, tokens: int, y_count: int, pairs: int) -> tuple[int, int]:
        """Multiply-adds per pair of samples of the Gram form and of contracting the layer's Jacobians."""


_RULES: dict[type[nn.Module], Rule] = {}
_CALL_RULES: dict[type[nn.Module], CallRule] = {}
_GHOST_RULES: dict[type[nn.Module], type] = {}


def register(*module_types: type[nn.Module], features: Callable[[nn.Module], int] | None = None
             ) -> Callable[[Rule], Rule]:
    """Decorator: use the decorated rule for these module types (and subclasses that keep their forward);
    ``features``: for a position-wise layer, how many trailing input dimensions its parameters act on (see the
    module docstring); without it the samples must be on the input's first dimension."""

    def deco(rule: Rule) -> Rule:
        rule.features = features
        for t in module_types:
            _register(_RULES, t, rule)
        return rule

    return deco


def register_call(*module_types: type[nn.Module], supports: Callable[[nn.Module], bool] | None = None,
                  capture: Callable | None = None) -> Callable[[CallRule], CallRule]:
    """Decorator: use the decorated call rule (several inputs / outputs) for these module types; ``supports(module)``
    says whether it covers that layer's configuration (else the layer goes through the per-layer fallback);
    ``capture``: the layer's forward as the rule needs it run (see the module docstring)."""

    def deco(rule: CallRule) -> CallRule:
        rule.supports = supports or (lambda module: True)
        rule.capture = capture
        for t in module_types:
            _register(_CALL_RULES, t, rule)
        return rule

    return deco


def register_ghost(*module_types: type[nn.Module]) -> Callable[[type], type]:
    """Class decorator: the :class:`GhostRule` of these module types (used only where their closed-form rule is)."""

    def deco(cls: type) -> type:
        for t in module_types:
            _register(_GHOST_RULES, t, cls)
        return cls

    return deco


def ghost_rule_for(module: nn.Module) -> GhostRule | None:
    """The :class:`GhostRule` for ``module``, or None (also where it does not apply to this configuration)."""
    ghost = _lookup(_GHOST_RULES, module)
    return ghost if ghost is not None and ghost.applies(module) else None


def join_positions(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A ghost rule's calls as one: activations (B, T_k, ...) joined along T (dim 1), gradients (N, B, T_k, ...)
    along dim 2."""
    if len(acts) == 1:
        return acts[0], grads[0]
    return torch.cat(list(acts), dim=1), torch.cat(list(grads), dim=2)


# The forward each registered type had when its rule was registered: a rule knows that forward only.
_FORWARDS: dict[type[nn.Module], Callable] = {}


def _register(registry: dict, module_type: type[nn.Module], entry: object) -> None:
    registry[module_type] = entry
    _FORWARDS.setdefault(module_type, module_type.forward)


def _lookup(registry: dict, module: nn.Module):
    """The entry for ``module``'s type or its nearest registered base, if ``module`` runs that type's forward."""
    if "forward" in module.__dict__:  # an instance's own forward (module.forward = ...): no rule knows it
        return None
    for base in type(module).__mro__:
        if base in registry:
            return registry[base] if type(module).forward is _FORWARDS[base] else None
    return None


def rule_for(module: nn.Module) -> Rule | None:
    """The single-tensor rule for ``module``, or None. A subclass that overrides ``forward`` gets no rule."""
    return _lookup(_RULES, module)


def rule_takes_batch_dim(module: nn.Module, dim: int | None, ndim: int) -> bool:
    """Whether ``module``'s single-tensor rule holds for an input of ``ndim`` dimensions with the samples on
    dimension ``dim`` (moved to the front for the rule): dimension 0 always; for a position-wise layer, any
    dimension before the ones its parameters act on."""
    rule = rule_for(module)
    if rule is None or dim is None:
        return False
    return dim == 0 or (rule.features is not None and dim < ndim - rule.features(module))


def call_rule_for(module: nn.Module) -> CallRule | None:
    """The call rule (several inputs / outputs) for ``module``, or None (also where it does not support the
    layer's configuration)."""
    rule = _lookup(_CALL_RULES, module)
    return rule if rule is not None and rule.supports(module) else None


def capture_for(module: nn.Module) -> Callable | None:
    """The capturing forward of ``module``'s call rule (see the module docstring), or None."""
    rule = call_rule_for(module)
    return None if rule is None else rule.capture


def supported_types() -> tuple[str, ...]:
    """Names of the module types that have a closed-form rule."""
    return tuple(sorted({t.__name__ for t in (*_RULES, *_CALL_RULES)}))


from . import activations, attention, conv, embedding, linear, normalization, recurrent  # noqa: E402,F401  (registers the rules)
