"""``python -m pergrad_viz``: argument parsing only (:mod:`.main` for ``bench``, :mod:`.scan` for ``scan`` and
``scan-bench``), calling the package."""
