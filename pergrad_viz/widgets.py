"""The interactive explorer, ``pv.widgets.explorer()``: a thin re-export of :mod:`pergrad_viz.explorer.view`
(the ipywidgets front end) over :mod:`pergrad_viz.explorer.model` (pure: setting -> views).

>>> import pergrad_viz as pv
>>> pv.widgets.explorer()          # in a notebook cell: the widget shows itself (a menu of networks)
>>> pv.widgets.explorer(model=net, loss_fn=loss_fn, data=(x, y))     # your own network on your data
"""

from __future__ import annotations

from pergrad_viz.explorer.model import ExplorerModel, Setting, View
from pergrad_viz.explorer.view import Explorer, explorer

__all__ = ["Explorer", "ExplorerModel", "Setting", "View", "explorer"]
