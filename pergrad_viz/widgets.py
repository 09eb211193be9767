"""The interactive explorer, ``pv.widgets.explorer()``: a thin re-export of :mod:`pergrad_viz.explorer` (the
ipywidgets front end :mod:`~pergrad_viz.explorer.view`, built by :mod:`~pergrad_viz.explorer.factory`, over the
pure :mod:`~pergrad_viz.explorer.model`: setting -> views).

>>> import pergrad_viz as pv
>>> pv.widgets.explorer()          # in a notebook cell: the widget shows itself (a menu of networks)
>>> pv.widgets.explorer(model=net, loss_fn=loss_fn, data=(x, y))     # your own network on your data
"""

from __future__ import annotations

from pergrad_viz.core.extras import missing_extra

try:  # what the widget is drawn with
    import IPython  # noqa: F401
    import ipywidgets  # noqa: F401
    import matplotlib  # noqa: F401
except ImportError as e:
    raise missing_extra(e.name or "ipywidgets", "pv.widgets.explorer() (the interactive explorer)",
                        extra="widgets") from e

from pergrad_viz.explorer.factory import explorer
from pergrad_viz.explorer.model import ExplorerModel
from pergrad_viz.explorer.state import Setting, View
from pergrad_viz.explorer.view import Explorer

__all__ = ["Explorer", "ExplorerModel", "Setting", "View", "explorer"]
