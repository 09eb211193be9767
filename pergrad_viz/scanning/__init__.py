"""Whole-dataset scans (``pv.scan``, ``pv.load_scan``): the scan itself (:mod:`.api`), how its chunks are shared
and walked (:mod:`.runner`), the per-batch quantities (:mod:`.compute`), the store on disk (:mod:`.store`) and
gradient sketches (:mod:`.sketch`).

The folder is ``scanning``, not ``scan``: ``pergrad_viz.scan`` is the function."""
