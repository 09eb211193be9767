"""Figures from plain data (numbers, arrays, records): no strategy internals. ``from pergrad_viz import viz``
then ``viz.gradient_heatmap(...)``; the figures live in :mod:`.plots`."""

import importlib


def __getattr__(name: str):
    plots = importlib.import_module("pergrad_viz.viz.plots")
    try:
        return getattr(plots, name)
    except AttributeError:
        raise AttributeError(f"module 'pergrad_viz.viz' has no attribute {name!r}") from None
