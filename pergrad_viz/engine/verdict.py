"""The per-call check's verdict (:mod:`pergrad_viz.engine.certify`): whether a result's rows are the reference's up
to rounding, the rounding settled in float64 where the result's precision leaves a doubt."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from pergrad_viz.core import tolerances
from pergrad_viz.engine.references import Tensors

AGAIN = 8.0  # a result may be this many times as far from the float64 value as the reference in its precision is
LOOSE = 30.0  # without a float64 copy, a suspicion fails beyond this many times the tolerance


def tolerance(dtype: torch.dtype, device: torch.device | None = None) -> float:
    """The check's relative tolerance per parameter tensor for results in ``dtype`` on ``device``
    (``core.tolerances``)."""
    return tolerances.tolerance(dtype, device).check


def float_norms(tensors: Tensors, dtype: torch.dtype) -> list[float]:
    """2-norms as floats, one ``_foreach_norm`` and one host read; again in float64 where one is not finite."""
    if not tensors:
        return []
    low = dtype in (torch.float16, torch.bfloat16)
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32 if low else None)).tolist()
    if not all(map(math.isfinite, norms)):
        norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).tolist()
    return norms


def fails(got: float, size: float, rtol: float) -> bool:
    return (got > rtol * size and got > 0) or (not math.isfinite(got) and math.isfinite(size))


def worst_row(diff: torch.Tensor, size: torch.Tensor, rtol: float) -> int | None:
    """The row whose difference ``diff`` (B,) is the furthest beyond ``rtol`` times its size (B,) (floored at 1e-3 of
    the largest, as a row of zeros is measured), a NaN the furthest; None where every row is within."""
    excess = diff / (rtol * torch.maximum(size, 1e-3 * size.max()))
    worst = int(torch.nan_to_num(excess, nan=math.inf).argmax())
    return None if bool(excess[worst] <= 1) else worst


def verdict(names: tuple[str, ...], got: Tensors, want: Tensors, dtype: torch.dtype,
            exact: Callable[[], Tensors | None], in_batch: Callable[[], tuple[Tensors, Tensors] | None] | None = None,
            floor: Callable[[], float] | None = None) -> tuple[str, float] | None:
    """The first parameter tensor where ``got`` (the result's) is not ``want`` (the reference in the result's
    precision) up to rounding, with its relative difference; None where every one passes. ``exact()``: the
    reference again in float64 (None where it cannot be had), asked only on a suspicion below float64.
    ``in_batch()``: for a reference of one sample alone, that sample's value from a forward of the whole batch, in
    the result's precision and on the float64 copy (None where it cannot be had), asked only before a failure.
    ``floor()``: a size below which no row counts as smaller, 1e-3 of the batch's largest row in the result (a
    sample whose gradient is 0, a loss at its minimum: its rounding is the batch's, not relative to 0), asked alike."""
    rtol = tolerance(dtype, want[0].device if want else None)
    n = len(want)
    norms = float_norms([*want, *torch._foreach_sub(got, want)], dtype)
    least, batch = 1e-3 * math.sqrt(sum(w * w for w in norms[:n])), 0.0
    for _ in range(2):
        suspects = [k for k in range(n) if fails(norms[n + k], max(norms[k], least, batch), rtol)]
        if not suspects or floor is None:
            break
        batch, floor = floor(), None
    least = max(least, batch)
    if not suspects:
        return None
    first = suspects[0]
    relative = norms[n + first] / max(norms[first], least, 1e-300)
    if dtype == torch.float64:
        return names[first], relative
    again = exact()
    if again is None:
        loose = [k for k in suspects if fails(norms[n + k], max(norms[k], least), LOOSE * rtol)]
        return None if not loose else (names[loose[0]], norms[n + loose[0]] / max(norms[loose[0]], 1e-300))
    pick = [got[k].double() - again[k] for k in suspects] + [want[k].double() - again[k] for k in suspects]
    pick += [again[k] for k in suspects]
    m = len(suspects)
    far = float_norms(pick, torch.float64)  # per suspect: |got - exact|, then |want - exact|, then |exact|
    total64 = math.sqrt(sum(a * a for a in float_norms(again, torch.float64)))
    failed = []  # (suspect k, |got - exact|, the row's size)
    for j, k in enumerate(suspects):
        size = max(far[2 * m + j], 1e-3 * total64, batch)
        allowed = max(rtol * size, AGAIN * far[m + j])  # rounding: as far off as the reference in its precision
        if (far[j] > allowed and far[j] > 0) or not math.isfinite(far[j]):
            failed.append((k, far[j], size))
    if failed and in_batch is not None:
        failed = _beyond_the_batch_rounding(failed, again, in_batch, rtol)
    return None if not failed else (names[failed[0][0]], failed[0][1] / max(failed[0][2], 1e-300))


def _beyond_the_batch_rounding(failed: list[tuple[int, float, float]], exact: Tensors,
                               in_batch: Callable[[], tuple[Tensors, Tensors] | None], rtol: float
                               ) -> list[tuple[int, float, float]]:
    """The failures that the batch's own rounding does not explain. A batch and a sample alone run different kernels
    (on CUDA, cuDNN's convolutions for 32 samples and for one), and in TF32 a deep network's gradient for a sample
    inside its batch can be 10x as far from float64's as the same sample's alone (ResNet-18 on an H200: 7e-2 against
    7e-4 for a layer3 convolution), the same in plain training. Where the float64 copy gives that sample the same
    value in its batch as alone (no coupling: float64's rounding), a result is allowed AGAIN times the distance
    between the batch's value in the result's precision and in float64."""
    both = in_batch()
    if both is None:
        return failed
    low, high = both
    kept = []
    for k, off, size in failed:
        coupling, rounding = float_norms([high[k] - exact[k], low[k].double() - high[k]], torch.float64)
        if not (coupling <= tolerances.DOUBLE.check * size and off <= max(rtol * size, AGAIN * rounding)):
            kept.append((k, off, size))
    return kept
