"""pergrad_viz: per-sample gradients (B, P) and per-sample output Jacobians (B, Y, P) in PyTorch,
without Python loops.

>>> import pergrad_viz as pv
>>> grads = pv.per_sample_grads(model, loss_fn, x, y)          # {name: (B, *param.shape)}
>>> J = pv.per_sample_jacobian(model, x, flat=True)           # (B, Y, P)
"""

from .api import per_sample_grads, per_sample_jacobian, resolve_strategy
from .errors import MemoryBudgetError, UnsupportedModelError
from .strategies import STRATEGIES

__all__ = [
    "STRATEGIES",
    "MemoryBudgetError",
    "UnsupportedModelError",
    "per_sample_grads",
    "per_sample_jacobian",
    "resolve_strategy",
]
