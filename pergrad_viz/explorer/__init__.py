"""The interactive explorer: a pure model (setting -> views) and a thin ipywidgets view.
``pv.widgets.explorer()`` builds the widget; the model works without ipywidgets.

One job per module, top to bottom:

* :mod:`.state`: the plain records (:class:`Setting` in; :class:`View`, :class:`Verdict`, :class:`SampleView`,
  :class:`ClipView` out; :class:`Stale`);
* :mod:`.specs`: what the explorer knows about a network (the built-in menu, a user's own);
* :mod:`.compute`, :mod:`.sample`: pure computations (the loop, verdicts, norms, the DP-SGD view, the sample panel);
* :mod:`.session`: timing, and the cache of timings;
* :mod:`.model`: :class:`ExplorerModel`, which calls the package and yields the views stage by stage;
* :mod:`.worker`: the background thread; :mod:`.panels`: figures and HTML from a view; :mod:`.page`: the output
  panes and the layout; :mod:`.view`: the widget (ipywidgets); :mod:`.factory`: ``explorer()``.
"""

from pergrad_viz.explorer.model import ExplorerModel
from pergrad_viz.explorer.state import ClipView, SampleView, Setting, Stale, Verdict, View

__all__ = ["ClipView", "ExplorerModel", "SampleView", "Setting", "Stale", "Verdict", "View"]
