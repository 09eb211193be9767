"""The fast path's engine, above the layer rules: the probe (:mod:`.probe`) and its plans (:mod:`.plan`), the
hooked forward and the backward to the layer outputs (:mod:`.capture`), the rules applied per call and layer
(:mod:`.grouping`) and the per-call check (:mod:`.certify`)."""
