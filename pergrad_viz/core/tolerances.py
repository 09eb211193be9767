"""One table of tolerances, by dtype: what "equal up to rounding" means wherever the package compares numbers.

* ``check``: the per-call check's relative tolerance per parameter tensor (``engine.certify``); a float32 or
  half-precision difference beyond it is settled against float64 before it counts (see there).
* ``probe``: the probe's (rtol, atol) for a layer's tensors in a batch and alone (``engine.observe``); atol is relative
  to each feature's magnitude.
* ``replay``: the per-layer fallback's short path against its ``vmap`` path (``rules.fallback``), relative and
  relative to the largest magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    check: float
    probe: tuple[float, float]
    replay: float


DOUBLE = Tolerance(check=1e-6, probe=(1e-7, 1e-9), replay=1e-10)
SINGLE = Tolerance(check=1e-3, probe=(1e-3, 1e-5), replay=1e-4)
HALF = Tolerance(check=5e-2, probe=(2e-2, 1e-3), replay=1e-2)
TOLERANCES: dict[torch.dtype, Tolerance] = {torch.float64: DOUBLE, torch.complex128: DOUBLE, torch.float32: SINGLE,
                                            torch.complex64: SINGLE, torch.float16: HALF, torch.bfloat16: HALF}


def tolerance(dtype: torch.dtype) -> Tolerance:
    """The tolerances for values in ``dtype`` (float32's for any other)."""
    return TOLERANCES.get(dtype, SINGLE)
