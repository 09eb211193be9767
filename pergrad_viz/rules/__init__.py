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
:class:`GhostRule`). ``@register_weighted_sum(*types)``, beside a ghost rule: the sum over samples of the
per-sample gradients weighted by c (B,), from the same captured inputs and output gradients (the clipped sum of
DP-SGD, ``pergrad_viz.derived.dp``), never the per-sample gradients; ``@register_linear_views(*types)``, beside a
call rule: the Linear maps inside one captured call (attention's projections), which then take those two.

Each decorator also takes a class path instead of a type, e.g. ``"transformers.pytorch_utils.Conv1D"``
(``f"{cls.__module__}.{cls.__qualname__}"``): registered lazily, resolved when a module of that class (or a subclass)
is first looked up, so that this package never imports transformers, timm or peft itself (``integrations/``).
A lazily registered class gets its rule only if its forward is the one written in its own class body (same module
and qualified name: not a forward patched onto it), and, where the registration gives ``forward_like=`` (a copy of
the forward the rule was written for), only if that forward compiles to the same code (so that a library release
that changes the forward, or a kin class that differs in one line, falls back instead of getting a wrong rule).

Rules are small pure functions: no state, no hooks of their own.
A rule is used only for a module whose forward is its registered type's own (not a subclass's, not an instance
attribute, not a forward patched onto the class after import or, for a lazily registered class, after its first
lookup); ``supports=`` may narrow it to some configurations of the layer. Layers that own trainable parameters but
have no rule go through the per-layer fallback (``pergrad_viz.rules.fallback``).
"""

from pergrad_viz.rules.registry import (
    CallRule,
    Captured,
    GhostRule,
    ModuleType,
    Rule,
    call_rule_for,
    capture_for,
    class_path,
    ghost_rule_for,
    join_positions,
    lazy_paths,
    linear_views_for,
    positions,
    register,
    register_call,
    register_ghost,
    register_linear_views,
    register_weighted_sum,
    rule_for,
    rule_takes_batch_dim,
    weighted_sum_rule_for,
    writes_fresh,
)

__all__ = [
    "CallRule",
    "Captured",
    "GhostRule",
    "ModuleType",
    "Rule",
    "call_rule_for",
    "capture_for",
    "class_path",
    "ghost_rule_for",
    "join_positions",
    "positions",
    "lazy_paths",
    "linear_views_for",
    "register",
    "register_call",
    "register_ghost",
    "register_linear_views",
    "register_weighted_sum",
    "rule_for",
    "rule_takes_batch_dim",
    "weighted_sum_rule_for",
    "writes_fresh",
]

# The rules register themselves on import; the integrations register by class path and import neither package.
from pergrad_viz.rules import (  # noqa: F401
    activations,
    attention,
    conv,
    embedding,
    linear,
    normalization,
    recurrent,
)
from pergrad_viz.rules.integrations import timm, transformers  # noqa: F401
