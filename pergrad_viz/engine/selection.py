"""What a Jacobian's ``output=`` selects from the model's output, seen by the probe: a selection that mixes the
samples (``o - o.mean(0)``, ``o / o.norm()``) or does not keep them first (``o.t()``) makes the samples interact, as
the same code inside the forward would (the batched strategies then do not run; ``auto`` computes each sample
alone)."""

from __future__ import annotations

from typing import Any


def selection_interaction(probe: Any) -> str | None:
    """Why the selection of ``output=`` is not per sample in ``probe``'s runs (engine.probe's: two samples alone,
    together in both orders), else None (also without ``output=``); called as the probe starts, before any layer."""
    runs = probe.alone_a, probe.alone_b, probe.pair, probe.swapped
    if any(run.selected is None for run in runs):
        return None
    scalar = next((t for t in probe.pair.selected if t.dim() == 0), None)
    if scalar is not None:
        return ("what output= selects from the model's output has shape () on a batch of 2: one value for all the "
                "samples (e.g. a sum over the batch), not one per sample (select per-sample values, e.g. o.sum(-1))")
    a, b, pair, swapped = (([], run.selected) for run in runs)
    spec = probe.call_spec("", probe.trainable.model, pair, swapped, [a, b])  # notes an interaction in the probe
    found = probe.interaction
    if isinstance(spec, str):
        found = spec
    elif found is None and any(d != 0 for d in spec.out_dims):
        found = "its samples are not along dimension 0"
    return None if found is None else f"what output= selects from the model's output: {found}"
