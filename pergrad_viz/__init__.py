"""pergrad_viz: per-sample gradients (B, P) and per-sample output Jacobians (B, Y, P) in PyTorch,
without Python loops, each equal to what a loop over the samples gives (or a clear error naming the fix).

>>> import torch, pergrad_viz as pv
>>> model, x, y = torch.nn.Linear(4, 3), torch.randn(8, 4), torch.randint(0, 3, (8,))
>>> grads = pv.per_sample_grads(model, torch.nn.CrossEntropyLoss(), x, y)   # {name: (B, *param.shape)}
>>> grads["weight"].shape
torch.Size([8, 3, 4])
>>> pv.per_sample_jacobian(model, x, flat=True).shape                       # (B, Y, P)
torch.Size([8, 3, 15])

Per sample (B samples, P trainable parameters, Y outputs a sample):
    per_sample_grads          the gradient of each sample's loss: {name: (B, *shape)}, or (B, P) with flat=True
    per_sample_jacobian       every output's gradient, per sample: {name: (B, Y, *shape)}, or (B, Y, P)
    per_sample_grad_norms     the (B,) norms of the per-sample gradients, without forming (B, P)
    empirical_ntk             the empirical NTK J1 J2^T: (N1, N2, Y, Y), or (N1, N2) with mode="trace"
    resolve_strategy          the strategy a call will use ("auto": hooks, else torch_func, else the loop)
DP-SGD:
    clipped_grad_sum          sum_i min(1, C / ||g_i||) g_i (+ noise), {name: (*shape)}, without (B, P)
    dp_step / noise_step      that over the expected batch size, put into .grad for any torch.optim optimiser
    clip_per_sample, dp_sgd_gradient   the same from a materialised (B, P)
    PoissonBatches, epsilon, noise_multiplier_for   Poisson sampling and Opacus' accountant (extra "dp")
Whole datasets: scan (per-example losses, gradient norms, sketches, to a directory), load_scan.
Losses for Hugging Face models: causal_lm_loss, sequence_classification_loss.
Lazily imported: pv.widgets.explorer() (the interactive explorer), pv.viz (figures), pv.bench, pv.tutorial.
"""
import importlib

from pergrad_viz import moved
from pergrad_viz.api import per_sample_grads, per_sample_jacobian, resolve_strategy
from pergrad_viz.core.losses import causal_lm_loss, sequence_classification_loss
from pergrad_viz.derived.clipping import clip_per_sample, dp_sgd_gradient
from pergrad_viz.derived.dp import clipped_grad_sum, dp_step, noise_step
from pergrad_viz.derived.norms import per_sample_grad_norms
from pergrad_viz.derived.ntk import empirical_ntk
from pergrad_viz.derived.privacy import PoissonBatches, epsilon, noise_multiplier_for
from pergrad_viz.errors import (
    CheckFailedError,
    HandOverError,
    MemoryBudgetError,
    MissingExtraError,
    PlanMismatchError,
    UndefinedPerSampleError,
    UnsupportedModelError,
    VmapError,
)
from pergrad_viz.scanning.api import load_scan, scan
from pergrad_viz.scanning.remote import RemoteTraceback
from pergrad_viz.scanning.store import ScanMismatchError
from pergrad_viz.strategies import STRATEGIES

__version__ = "0.1.0"  # the single source: pyproject.toml reads it (dynamic version); CHANGELOG.md

__all__ = [
    "STRATEGIES",
    # the exceptions a caller may catch (every public one the package defines)
    "CheckFailedError",
    "HandOverError",
    "MemoryBudgetError",
    "MissingExtraError",
    "PlanMismatchError",
    "PoissonBatches",
    "RemoteTraceback",
    "ScanMismatchError",
    "UndefinedPerSampleError",
    "UnsupportedModelError",
    "VmapError",
    "causal_lm_loss",
    "clip_per_sample",
    "clipped_grad_sum",
    "dp_sgd_gradient",
    "dp_step",
    "empirical_ntk",
    "epsilon",
    "load_scan",
    "noise_multiplier_for",
    "noise_step",
    "per_sample_grad_norms",
    "per_sample_grads",
    "per_sample_jacobian",
    "resolve_strategy",
    "scan",
    "sequence_classification_loss",
]


moved.install()

_LAZY = {  # matplotlib / ipywidgets / data: imported on first use (pv.widgets.explorer(), pv.viz.gradient_heatmap)
    "widgets": "pergrad_viz.widgets",
    "viz": "pergrad_viz.viz",
    "bench": "pergrad_viz.bench",
    "tutorial": "pergrad_viz.tutorial",
    "explorer": "pergrad_viz.explorer",
}


def __getattr__(name: str):
    if name in _LAZY:
        return importlib.import_module(_LAZY[name])
    old = f"{__name__}.{name}"
    if old in moved.MOVED:  # pv.plots, pv.data, pv.models, ... of version 0.1
        moved.warn_moved(old, moved.MOVED[old])
        return importlib.import_module(moved.MOVED[old])
    raise AttributeError(f"module 'pergrad_viz' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public API and the lazily imported subpackages (not the modules this file imports to build them)."""
    return sorted({*__all__, *_LAZY, "__version__"})
