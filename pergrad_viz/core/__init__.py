"""What every strategy stands on: the call's batch (:mod:`.batch`), the trainable parameters and restoring the
model's modes (:mod:`.trainable`), per-sample losses (:mod:`.losses`) and memory budgets (:mod:`.memory`).
Imports nothing of the package but :mod:`pergrad_viz.errors`."""
