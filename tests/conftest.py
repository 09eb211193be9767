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
