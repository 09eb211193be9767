"""Figures from plain data (numbers, arrays, benchmark records): no strategy internals.

``from pergrad_viz import viz`` then ``viz.gradient_heatmap(...)``. Importing this package imports matplotlib
(``import pergrad_viz`` does not: ``pergrad_viz.viz`` is imported on first use). Every function returns the
:class:`~matplotlib.figure.Figure` it drew on, built on the object API (never ``pyplot``); in a notebook, show
it by leaving it as a cell's last expression (inline backend) or with :func:`to_png`; everything works headless
(the Agg renderer).

The figures, by what they show:

- :mod:`~pergrad_viz.viz.timings`: benchmark timings (:func:`runtime_figure`, :func:`bar_figure`,
  :func:`dp_cost_figure`, :func:`fmt_seconds`, :func:`fmt_ratio`);
- :mod:`~pergrad_viz.viz.gradients`: the gradients themselves (:func:`gradient_heatmap`,
  :func:`first_layer_images`, :func:`robust_limit`; :func:`param_boundaries` gives a heatmap's layers);
- :mod:`~pergrad_viz.viz.fast_rule`: how a layer's fast rule builds a sample's gradient
  (:func:`outer_product_figure`, :func:`factor_figure`, :func:`token_figure`);
- :mod:`~pergrad_viz.viz.applications`: what they are for (:func:`image_grid`, :func:`norm_histogram`,
  :func:`clipping_figure`, :func:`grouped_heatmap`, :func:`aligned_edges`, :func:`right_closed_counts`);
- :mod:`~pergrad_viz.viz.canvas`: what they all stand on (:func:`to_png`, :func:`fit_text`, the colours).
"""

from pergrad_viz.core.extras import missing_extra

try:
    import matplotlib  # noqa: F401  (every figure is a matplotlib Figure)
except ImportError as e:
    raise missing_extra("matplotlib", "pergrad_viz.viz (the figures)") from e

from pergrad_viz.core.layout import param_boundaries
from pergrad_viz.viz.applications import (
    aligned_edges,
    clipping_figure,
    grouped_heatmap,
    image_grid,
    norm_histogram,
    right_closed_counts,
)
from pergrad_viz.viz.canvas import DIVERGING, REFERENCES, fit_text, to_png
from pergrad_viz.viz.fast_rule import factor_figure, outer_product_figure, token_figure
from pergrad_viz.viz.gradients import Boundaries, first_layer_images, gradient_heatmap, robust_limit
from pergrad_viz.viz.timings import bar_figure, dp_cost_figure, fmt_ratio, fmt_seconds, runtime_figure

__all__ = [
    "DIVERGING",
    "REFERENCES",
    "Boundaries",
    "aligned_edges",
    "bar_figure",
    "clipping_figure",
    "dp_cost_figure",
    "factor_figure",
    "first_layer_images",
    "fit_text",
    "fmt_ratio",
    "fmt_seconds",
    "gradient_heatmap",
    "grouped_heatmap",
    "image_grid",
    "norm_histogram",
    "outer_product_figure",
    "param_boundaries",
    "right_closed_counts",
    "robust_limit",
    "runtime_figure",
    "to_png",
    "token_figure",
]
