"""The interactive explorer: a pure model (:mod:`.model`: setting -> views) and a thin ipywidgets view
(:mod:`.view`). ``pv.widgets.explorer()`` builds the widget; the model works without ipywidgets."""

from pergrad_viz.explorer.model import ClipView, ExplorerModel, SampleView, Setting, Stale, Verdict, View

__all__ = ["ClipView", "ExplorerModel", "SampleView", "Setting", "Stale", "Verdict", "View"]
