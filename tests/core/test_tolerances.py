"""core/tolerances: float32 computed at TF32's precision on CUDA is compared as float16 is, float32 elsewhere as
float32 (no GPU needed: the settings are read, not used)."""

from __future__ import annotations

import pytest
import torch

from pergrad_viz.core.tolerances import HALF, SINGLE, TF32, tolerance

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize(("conv", "matmul", "device", "want"), [
    (True, False, CUDA, TF32),  # PyTorch's defaults: cuDNN's convolutions in TF32
    (False, True, CUDA, TF32),  # torch.set_float32_matmul_precision("high")
    (False, False, CUDA, SINGLE),
    (True, True, CPU, SINGLE),
])
def test_float32_at_tf32_precision(tf32_settings, conv, matmul, device, want):
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = conv, matmul
    assert tolerance(torch.float32, device) is want
    assert tolerance(torch.float64, device).check == 1e-6  # float64 is never rounded to TF32
    assert tolerance(torch.float16, device) is HALF
