"""The fast path's engine, above the layer rules: the probe and its plans (:mod:`.probe`) and the per-call
check (:mod:`.certify`)."""
