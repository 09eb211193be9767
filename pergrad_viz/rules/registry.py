"""The rule registry: the four decorators (``register``, ``register_call``, ``register_ghost``,
``register_weighted_sum``), the lazy registration by class path, and one lookup (:func:`rule_for`,
:func:`call_rule_for`, :func:`ghost_rule_for`, :func:`weighted_sum_rule_for` and :func:`capture_for` all go
through it). What a rule is and may assume: see :mod:`pergrad_viz.rules`."""

from __future__ import annotations

import math
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
    def direct_bytes(module: nn.Module, seen: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int | None:
        """Optional: where a cheaper form than ``stack`` and ``squared_norms`` exists for this layer and the shapes
        of these calls ``[(activation (B, ...), grad_output (B, ...))]`` (a convolution's Gram from its input
        pixels, not its im2col columns), the bytes of temporaries it takes per sample; else None."""

    @staticmethod
    def direct_norms(module: nn.Module, seen: Sequence[tuple[torch.Tensor, torch.Tensor]], local: Collection[str]
                     ) -> dict[str, torch.Tensor]:
        """``squared_norms`` of these calls in that form, where ``direct_bytes`` is not None."""

    @staticmethod
    def instantiates(module: nn.Module, seen: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Optional: whether the clipped sum of DP-SGD should take this layer's per-sample gradients from its dense
        rule for these calls ``[(activation (B, ...), grad_output (B, ...))]`` (their norms, then one weighted sum)
        rather than its ghost norm and weighted-sum rule (``pergrad_viz.derived.bookkeeping``); absent: never."""

    @staticmethod
    def factors(module: nn.Module, a: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The weight's per-sample gradient, read as the matrix W.view(rows, -1), as ``sum_t outer(left_t,
        right_t)``: ``(left, right)`` from ``stack``'s a and g[0], left (B, T, rows) or (B, T) integer rows (one-hot
        left vectors: an Embedding's indices), right (B, T, cols); None where the rule gives no such factors. What
        the norm of a weight tied between layers is made of (its cross terms, ``pergrad_viz.derived.norms``)."""

    @staticmethod
    def overlap(a1: torch.Tensor, a2: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """(N1, N2, T, S): what the weight's kernel term multiplies g_t . g_s by (a_t . a_s for Linear)."""

    @staticmethod
    def gram_cost(module: nn.Module, tokens: int, y_count: int, pairs: int) -> tuple[int, int]:
        """Multiply-adds per pair of samples of the Gram form and of contracting the layer's Jacobians."""


class _Registry:
    """Entries by module type, and by class path (``"package.module.Class"``) until a module of that class is
    looked up (see the module docstring)."""

    def __init__(self) -> None:
        self.types: dict[type[nn.Module], object] = {}
        self.paths: dict[str, tuple[object, Callable | None]] = {}  # path -> (entry, forward_like)
        self.refused: set[type] = set()  # lazily registered classes whose forward is not the one the rule knows

    def add(self, target: type[nn.Module] | str, entry: object, forward_like: Callable | None = None) -> None:
        if isinstance(target, str):
            self.paths[target] = (entry, forward_like)
        else:
            self.types[target] = entry
            _FORWARDS.setdefault(target, target.forward)

    def resolve(self, cls: type) -> bool:
        """Whether ``cls`` has an entry (resolving a lazy one on first sight)."""
        if cls in self.types:
            return True
        if not self.paths or cls in self.refused:
            return False
        pending = self.paths.pop(class_path(cls), None)
        if pending is None:
            return False
        entry, forward_like = pending
        if _own_forward(cls, forward_like):
            self.add(cls, entry)
            return True
        self.refused.add(cls)
        return False


def class_path(cls: type) -> str:
    """``"package.module.Class"``: how a class is named for lazy registration."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _own_forward(cls: type, forward_like: Callable | None) -> bool:
    """Whether ``cls.forward`` is the one written in ``cls``'s own body (not inherited, not patched on) and, given
    ``forward_like``, compiles to the same code."""
    forward = cls.__dict__.get("forward")
    code = getattr(forward, "__code__", None)
    if code is None or forward.__qualname__ != f"{cls.__qualname__}.forward" or forward.__module__ != cls.__module__:
        return False
    if forward_like is None:
        return True
    like = forward_like.__code__
    return (code.co_flags & _CODE_FLAGS) == (like.co_flags & _CODE_FLAGS) and all(
        getattr(code, a) == getattr(like, a) for a in (
            "co_code", "co_consts", "co_names", "co_varnames", "co_argcount", "co_posonlyargcount",
            "co_kwonlyargcount"))


# What a code object's flags say about how it runs (the __future__ flags of its module, e.g. annotations, do not).
_CODE_FLAGS = (1 << 16) - 1


_RULES = _Registry()
_CALL_RULES = _Registry()
_GHOST_RULES = _Registry()
_SUM_RULES = _Registry()
_VIEW_RULES = _Registry()

ModuleType = type[nn.Module] | str  # a type, or a class path registered lazily


def register(*module_types: ModuleType, features: Callable[[nn.Module], int] | None = None,
             supports: Callable[[nn.Module], bool] | None = None, forward_like: Callable | None = None
             ) -> Callable[[Rule], Rule]:
    """Decorator: use the decorated rule for these module types (and subclasses that keep their forward);
    ``features``: for a position-wise layer, how many trailing input dimensions its parameters act on (see the
    module docstring); without it the samples must be on the input's first dimension. ``supports(module)``: whether
    the rule covers that layer's configuration (else the per-layer fallback); ``forward_like``: for class paths,
    the forward the rule was written for (see the module docstring)."""

    def deco(rule: Rule) -> Rule:
        rule.features = features
        rule.supports = supports or (lambda module: True)
        for t in module_types:
            _RULES.add(t, rule, forward_like)
        return rule

    return deco


def register_call(*module_types: ModuleType, supports: Callable[[nn.Module], bool] | None = None,
                  capture: Callable | None = None, forward_like: Callable | None = None
                  ) -> Callable[[CallRule], CallRule]:
    """Decorator: use the decorated call rule (several inputs / outputs) for these module types; ``supports(module)``
    says whether it covers that layer's configuration (else the layer goes through the per-layer fallback);
    ``capture``: the layer's forward as the rule needs it run (see the module docstring)."""

    def deco(rule: CallRule) -> CallRule:
        rule.supports = supports or (lambda module: True)
        rule.capture = capture
        for t in module_types:
            _CALL_RULES.add(t, rule, forward_like)
        return rule

    return deco


def register_ghost(*module_types: ModuleType, forward_like: Callable | None = None) -> Callable[[type], type]:
    """Class decorator: the :class:`GhostRule` of these module types (used only where their closed-form rule is)."""

    def deco(cls: type) -> type:
        for t in module_types:
            _GHOST_RULES.add(t, cls, forward_like)
        return cls

    return deco


# out[name] += sum_i c_i g_i for one layer: (module, seen [(activation (B, ...), grad_output (B, ...))],
# {local name: c (B,)}, out {local name: Tensor (*param.shape)}); ``seen`` has the samples first, one per call.
WeightedSumRule = Callable[[nn.Module, Sequence[tuple[torch.Tensor, torch.Tensor]], dict[str, torch.Tensor],
                            dict[str, torch.Tensor]], None]


def register_weighted_sum(*module_types: ModuleType, forward_like: Callable | None = None, writes_fresh: bool = False
                          ) -> Callable[[WeightedSumRule], WeightedSumRule]:
    """Decorator: the weighted sum over samples of the per-sample gradients, ``sum_i c_i g_i``, of these module types
    straight from the captured inputs and output gradients (book-keeping: never the (B, *param.shape) gradients);
    used only where the type's ghost rule applies (the norms come from it). ``writes_fresh``: the rule takes a fifth
    argument, the local names whose ``out`` tensors hold no values yet (allocated, not zeroed), and its first
    contribution to each writes it whole (``addmm_(..., beta=0)``, ``copy_``); other rules get zeroed tensors."""

    def deco(rule: WeightedSumRule) -> WeightedSumRule:
        for t in module_types:
            _SUM_RULES.add(t, rule, forward_like)
        if writes_fresh:
            _WRITES_FRESH.add(rule)
        return rule

    return deco


_WRITES_FRESH: set[Callable] = set()


def writes_fresh(rule: WeightedSumRule) -> bool:
    """Whether ``rule`` was registered with ``writes_fresh=True`` (see :func:`register_weighted_sum`)."""
    return rule in _WRITES_FRESH


def weighted_sum_rule_for(module: nn.Module) -> WeightedSumRule | None:
    """The weighted-sum rule of ``module``, or None (also where its ghost rule does not apply)."""
    rule = _lookup(_SUM_RULES, module)
    return rule if rule is not None and ghost_rule_for(module) is not None else None


# A call layer's Linear maps: (module, inputs (args, kwargs), grad_outputs, captured, captured_grads) ->
# [(a (B, T, in), g (B, T, out), {"weight": local name, "bias": local name})] or None (N = 1 dropped).
LinearViews = Callable[..., list[tuple[torch.Tensor, torch.Tensor, dict[str, str]]] | None]


def register_linear_views(*module_types: ModuleType) -> Callable[[LinearViews], LinearViews]:
    """Decorator: for a call layer (``register_call``) made of Linear maps applied at every token (attention's
    in- and out-projections), the (input, output gradient) pairs of those maps in one captured call, so that its
    norms and weighted sums take the Linear's ghost norm and book-keeping (None: the layer's own rule instead)."""

    def deco(rule: LinearViews) -> LinearViews:
        for t in module_types:
            _VIEW_RULES.add(t, rule)
        return rule

    return deco


def linear_views_for(module: nn.Module) -> LinearViews | None:
    """The linear-views rule of ``module`` where its call rule applies, or None."""
    rule = _lookup(_VIEW_RULES, module)
    return rule if rule is not None and call_rule_for(module) is not None else None


def ghost_rule_for(module: nn.Module) -> GhostRule | None:
    """The :class:`GhostRule` for ``module``, or None (also where it does not apply to this configuration)."""
    ghost = _lookup(_GHOST_RULES, module)
    return ghost if ghost is not None and ghost.applies(module) else None


def positions(t: torch.Tensor, *lead: int) -> torch.Tensor:
    """``t`` (*lead, *, width) as (*lead, T, width), T the product of the middle dimensions (1 where there are none);
    unlike ``reshape(*lead, -1, width)`` also where ``width`` or T is 0 (a zero-width layer)."""
    width = t.shape[-1]
    return t.reshape(*lead, math.prod(t.shape[len(lead):-1]), width)


def join_positions(acts: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A ghost rule's calls as one: activations (B, T_k, ...) joined along T (dim 1), gradients (N, B, T_k, ...)
    along dim 2."""
    if len(acts) == 1:
        return acts[0], grads[0]
    return torch.cat(list(acts), dim=1), torch.cat(list(grads), dim=2)


# The forward each registered type had when its rule was registered: a rule knows that forward only.
_FORWARDS: dict[type[nn.Module], Callable] = {}


def _lookup(registry: _Registry, module: nn.Module):
    """The entry for ``module``'s type or its nearest registered base, if ``module`` runs that type's forward."""
    if "forward" in module.__dict__:  # an instance's own forward (module.forward = ...): no rule knows it
        return None
    for base in type(module).__mro__:
        if base in registry.refused:
            return None
        if registry.resolve(base):
            return registry.types[base] if type(module).forward is _FORWARDS[base] else None
    return None


def rule_for(module: nn.Module) -> Rule | None:
    """The single-tensor rule for ``module``, or None (also where it does not support the layer's configuration).
    A subclass that overrides ``forward`` gets no rule."""
    rule = _lookup(_RULES, module)
    return rule if rule is not None and rule.supports(module) else None


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


def lazy_paths() -> tuple[str, ...]:
    """Class paths registered lazily and not yet resolved (their packages need not be installed)."""
    return tuple(sorted({*_RULES.paths, *_CALL_RULES.paths, *_GHOST_RULES.paths, *_SUM_RULES.paths,
                              *_VIEW_RULES.paths}))
