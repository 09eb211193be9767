"""pergrad_viz: per-sample gradients (B, P) and per-sample output Jacobians (B, Y, P) in PyTorch,
without Python loops.

>>> import pergrad_viz as pv
>>> grads = pv.per_sample_grads(model, loss_fn, x, y)          # {name: (B, *param.shape)}
>>> J = pv.per_sample_jacobian(model, x, flat=True)           # (B, Y, P)
"""

import importlib

from .api import per_sample_grads, per_sample_jacobian, resolve_strategy
from .clipping import clip_per_sample, dp_sgd_gradient
from .errors import MemoryBudgetError, UnsupportedModelError
from .losses import causal_lm_loss, sequence_classification_loss
from .norms import per_sample_grad_norms
from .ntk import empirical_ntk
from .scan import load_scan, scan
from .strategies import STRATEGIES

__version__ = "0.1.0"  # the single source: pyproject.toml reads it (dynamic version); CHANGELOG.md

__all__ = [
    "STRATEGIES",
    "MemoryBudgetError",
    "UnsupportedModelError",
    "causal_lm_loss",
    "clip_per_sample",
    "dp_sgd_gradient",
    "empirical_ntk",
    "load_scan",
    "per_sample_grad_norms",
    "per_sample_grads",
    "per_sample_jacobian",
    "resolve_strategy",
    "scan",
    "sequence_classification_loss",
]


def __getattr__(name: str):
    # bench, plots and widgets pull in matplotlib / ipywidgets: imported on first use (pv.widgets.explorer()).
    if name in ("bench", "plots", "widgets", "data", "models"):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'pergrad_viz' has no attribute {name!r}")
