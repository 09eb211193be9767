"""MemoryBudgetError's message says what to do, and what it says works: the budget, what one sample takes, a
chunk_size= that fits, a batch that fits, a max_bytes= that fits; never "about 0 samples fit"."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.errors import human_bytes

P = 110  # nn.Linear(10, 10)
ROW = P * 8  # one sample's row of a float64 result; torch_func's working memory per sample of a chunk is the same


def _call(batch: int, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(10, 10).double()
    x, y = torch.randn(batch, 10, dtype=torch.float64), torch.randn(batch, 10, dtype=torch.float64)
    return pv.per_sample_grads(model, nn.MSELoss(), x, y, strategy="torch_func", flat=True, **kwargs)


def _message(batch: int, **kwargs) -> str:
    with pytest.raises(pv.MemoryBudgetError) as info:
        _call(batch, **kwargs)
    return str(info.value)


def test_the_suggested_chunk_size_batch_and_budget_fit():
    budget = 8 * ROW + 3 * ROW + ROW // 2  # the result of 8 and the working memory of 3 samples
    msg = _message(8, max_bytes=budget)  # chunk 8 by default: 8 + 8 rows
    assert f"budget of {human_bytes(budget)} (max_bytes)" in msg
    assert f"One sample takes about {human_bytes(2 * ROW)}" in msg
    assert "samples fit" in msg and "about 0 samples" not in msg
    chunk = int(re.search(r"pass chunk_size=(\d+) or less", msg).group(1))
    assert chunk == 3
    _call(8, max_bytes=budget, chunk_size=chunk)
    with pytest.raises(pv.MemoryBudgetError):
        _call(8, max_bytes=budget, chunk_size=chunk + 1)
    need = int(re.search(r"raise max_bytes= to (\d+) or more", msg).group(1))
    assert need == 16 * ROW
    _call(8, max_bytes=need)
    with pytest.raises(pv.MemoryBudgetError):
        _call(8, max_bytes=need - 1)


def test_a_batch_that_fits_is_named_when_the_result_alone_is_too_large():
    budget = 5 * ROW + ROW // 2  # less than the result of 8
    msg = _message(8, max_bytes=budget)
    fits = int(re.search(r"about (\d+) samples fit, with chunk_size=1", msg).group(1))
    assert fits == 4  # 4 rows + one sample's working memory <= 5.5 rows
    torch.testing.assert_close(_call(fits, max_bytes=budget, chunk_size=1),
                               _call(fits, max_bytes=None, chunk_size=None))
    with pytest.raises(pv.MemoryBudgetError):
        _call(fits + 1, max_bytes=budget, chunk_size=1)


def test_when_one_sample_is_too_large_it_says_so_and_names_max_bytes():
    msg = _message(8, max_bytes=ROW)  # one sample: a row and its working memory, 2 rows
    assert "about 0 samples" not in msg
    assert "a smaller batch or chunk_size= does not help: one sample alone needs about" in msg
    assert f"raise max_bytes= to {16 * ROW} or more" in msg
    assert "pass chunk_size=" not in msg


def test_with_out_only_the_working_memory_counts_and_chunk_size_is_named():
    out = torch.empty(8, P, dtype=torch.float64)
    msg = _message(8, max_bytes=2 * ROW, out=out)
    assert "in your out= buffer" in msg and "samples fit" not in msg
    chunk = int(re.search(r"pass chunk_size=(\d+) or less", msg).group(1))
    assert chunk == 2
    assert _call(8, max_bytes=2 * ROW, out=out, chunk_size=chunk) is out
