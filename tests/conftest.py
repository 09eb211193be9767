"""Shared settings for the unit tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead (and spin when the CPUs are shared)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def tf32_settings():
    """PyTorch's TF32 settings restored after the test (it may change them: tests/core/test_tolerances.py,
    tests/test_cuda.py)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
