"""The optional packages (pyproject.toml's extras): importing one where a feature needs it, or an error naming the
extra to install. ``import pergrad_viz`` and the computations need torch and numpy only."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from pergrad_viz.errors import MissingExtraError

EXTRAS: dict[str, tuple[str, str]] = {  # module -> (the package pip installs, the extra that brings it)
    "matplotlib": ("matplotlib", "viz"),
    "ipywidgets": ("ipywidgets", "widgets"),
    "IPython": ("ipython", "widgets"),
    "torchvision": ("torchvision", "tutorial"),
    "transformers": ("transformers", "hf"),
    "timm": ("timm", "hf"),
    "peft": ("peft", "hf"),
    "opacus": ("opacus", "peers"),
    "backpack": ("backpack-for-pytorch", "peers"),
}


def missing_extra(module: str, feature: str, extra: str | None = None) -> MissingExtraError:
    """The error for ``feature`` when ``module`` (a key of :data:`EXTRAS`, or any module with ``extra`` given)
    cannot be imported; ``extra`` overrides the extra named (where a feature's own extra brings the package, e.g.
    ``bench`` for torchvision's models)."""
    top = module.partition(".")[0]
    package, default = EXTRAS.get(top, (top, extra))
    extra = extra or default
    return MissingExtraError(
        f"{feature} needs {package}, which is not installed: pip install 'pergrad-viz[{extra}]' "
        f"(or pip install {package})", name=module)


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingExtraError` naming the extra (see
    :func:`missing_extra`); the ImportError that failed is chained to it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing_extra(module, feature, extra) from e


def available(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (False where ``sys.modules`` blocks it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: sys.modules[module] is None
        return False
