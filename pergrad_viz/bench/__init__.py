"""Benchmarks that print side-by-side tables: sweeps and comparisons (:mod:`.sweeps`), interleaved timing
(:mod:`.timing`), the benchmark problems (:mod:`.problems`), the peers Opacus and BackPACK (:mod:`.peers`),
the targets (:mod:`.targets`) and scan throughput (:mod:`.scans`).

``from pergrad_viz import bench; bench.sweep(...)`` keeps working: the names of :mod:`.records` and
:mod:`.sweeps` are read through.
"""

import importlib


def __getattr__(name: str):
    for module in ("pergrad_viz.bench.records", "pergrad_viz.bench.sweeps"):
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            return found
    raise AttributeError(f"module 'pergrad_viz.bench' has no attribute {name!r}")
