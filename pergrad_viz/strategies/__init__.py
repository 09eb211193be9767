"""The strategies: one module per strategy (``loop``, ``autograd_stack``, ``torch_func``, ``batched_grad``,
``hooks``), each a thin client of ``pergrad_viz.core`` and ``pergrad_viz.engine``, and a typed registry
(:mod:`.registry`): :class:`Strategy` records in :data:`REGISTRY`, their names in :data:`STRATEGIES`."""

from pergrad_viz.strategies.registry import REGISTRY, STRATEGIES, Strategy, working_bytes

__all__ = ["REGISTRY", "STRATEGIES", "Strategy", "working_bytes"]
