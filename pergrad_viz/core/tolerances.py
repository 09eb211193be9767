"""One table of tolerances, by dtype: what "equal up to rounding" means wherever the package compares numbers.

* ``check``: the per-call check's relative tolerance per parameter tensor (``engine.certify``); a float32 or
  half-precision difference beyond it is settled against float64 before it counts (see there).
* ``probe``: the probe's (rtol, atol) for a layer's tensors in a batch and alone (``engine.observe``); atol is relative
  to each feature's magnitude.
* ``replay``: the per-layer fallback's short path against its ``vmap`` path (``rules.fallback``), relative and
  relative to the largest magnitude.

float32 on a CUDA device that rounds float32 products to TF32 (10 bits of mantissa, float16's: cuDNN's convolutions
by default on NVIDIA GPUs since Ampere, matmuls after ``torch.set_float32_matmul_precision("high")``) is compared as
float16 is: a batch of 32 and a sample alone take different kernels, whose results differ by TF32's rounding, not
float32's (ResNet-18 on an H200 was refused as "the samples interact" with float32's tolerance).
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


TF32 = HALF


def rounds_float32_to_tf32(device: torch.device | None) -> bool:
    """Whether float32 convolutions or matmuls on ``device`` may round their products to TF32 (read at each call:
    the user's settings may change between calls)."""
    return (device is not None and device.type == "cuda"
            and bool(torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32))


def tolerance(dtype: torch.dtype, device: torch.device | None = None) -> Tolerance:
    """The tolerances for values in ``dtype`` (float32's for any other) computed on ``device`` (float32 at TF32's
    precision where the device rounds to it, :func:`rounds_float32_to_tf32`)."""
    if dtype == torch.float32 and rounds_float32_to_tf32(device):
        return TF32
    return TOLERANCES.get(dtype, SINGLE)
