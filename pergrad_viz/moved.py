"""Old module paths, kept working for now: ``import pergrad_viz.plots`` gives :mod:`pergrad_viz.viz`.

Version 0.1 kept 29 modules flat in ``pergrad_viz/``; they now live one folder per capability (see
``docs/layout.md``). Importing an old path returns the module at its new place (the same module object, so
attributes set on one are seen through the other) and warns once with a :class:`DeprecationWarning` naming the
new path. The public API (``pergrad_viz.per_sample_grads``, ``pv.scan``, ``pv.widgets.explorer``, ...) did not move.
(``pergrad_viz.scan`` is the function, as before: the module that held it is :mod:`pergrad_viz.scanning.api`.)
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType

MOVED: dict[str, str] = {  # old path -> new path
    "pergrad_viz.batch": "pergrad_viz.core.batch",
    "pergrad_viz.trainable": "pergrad_viz.core.trainable",
    "pergrad_viz.losses": "pergrad_viz.core.losses",
    "pergrad_viz.memory": "pergrad_viz.core.memory",
    "pergrad_viz.probe": "pergrad_viz.engine.probe",
    "pergrad_viz.certify": "pergrad_viz.engine.certify",
    "pergrad_viz.norms": "pergrad_viz.derived.norms",
    "pergrad_viz.ntk": "pergrad_viz.derived.ntk",
    "pergrad_viz.clipping": "pergrad_viz.derived.clipping",
    "pergrad_viz.scan_store": "pergrad_viz.scanning.store",
    "pergrad_viz.scan_compute": "pergrad_viz.scanning.compute",
    "pergrad_viz.sketch": "pergrad_viz.scanning.sketch",
    "pergrad_viz.bench_models": "pergrad_viz.bench.problems",
    "pergrad_viz.bench_targets": "pergrad_viz.bench.targets",
    "pergrad_viz.scan_bench": "pergrad_viz.bench.scans",
    "pergrad_viz.peers": "pergrad_viz.bench.peers",
    "pergrad_viz.timing": "pergrad_viz.bench.timing",
    "pergrad_viz.plots": "pergrad_viz.viz",
    "pergrad_viz.data": "pergrad_viz.tutorial.data",
    "pergrad_viz.datasets": "pergrad_viz.tutorial.fashion_mnist",
    "pergrad_viz.tutorial.datasets": "pergrad_viz.tutorial.fashion_mnist",
    "pergrad_viz.models": "pergrad_viz.tutorial.networks",
    "pergrad_viz.label_noise": "pergrad_viz.tutorial.label_noise",
    "pergrad_viz.zoo_hf": "pergrad_viz.tutorial.hf_models",
    "pergrad_viz.sample": "pergrad_viz.tutorial.sample",
    "pergrad_viz.sample.make_sample": "pergrad_viz.tutorial.sample.make_sample",
    "pergrad_viz.cli_args": "pergrad_viz.cli.args",
    "pergrad_viz.cli_scan": "pergrad_viz.cli.scan",
}


def warn_moved(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there (the old path goes in a later release)",
                  DeprecationWarning, stacklevel=stacklevel)


class _Alias(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.own_spec  # loading under the old name replaced it with the alias's spec


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old flat paths of :data:`MOVED` and hands back the module at its new path."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warn_moved(fullname, new, stacklevel=4)
        return importlib.machinery.ModuleSpec(fullname, _Alias(new), is_package=fullname == "pergrad_viz.sample")


def install() -> None:
    """Put the finder on ``sys.meta_path`` once (``import pergrad_viz`` does this)."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())  # before the path finder, which would load a second copy of
        # a moved package's submodule (pergrad_viz.sample.make_sample) through the alias's __path__
