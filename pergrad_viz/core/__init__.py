"""What every strategy stands on: the call's batch (:mod:`.batch`), every check of a call (:mod:`.validate`), the
trainable parameters and restoring the model's modes (:mod:`.trainable`), which module owns a parameter
(:mod:`.ownership`), the flat (B, [Y,] P) layout (:mod:`.layout`), per-sample losses (:mod:`.losses`) and memory
budgets (:mod:`.memory`). Imports nothing of the package but :mod:`pergrad_viz.errors`."""
