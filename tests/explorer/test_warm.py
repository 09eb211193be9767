"""The explorer's last idle work (explorer/prefetch.warm_results): the largest result's memory written once and kept by
core.memory, so that the result of that size, when it comes, reuses it."""

from __future__ import annotations

import pytest
import torch

from pergrad_viz.core import memory
from pergrad_viz.explorer import prefetch


@pytest.fixture(autouse=True)
def _nothing_kept():
    memory.PAGES.release()
    yield
    memory.PAGES.release()


@pytest.mark.skipif(not memory.OWN_MAPPINGS, reason="results in mappings of their own: Linux only")
def test_warmed_memory_is_kept_for_the_next_results_of_that_size():
    shape = (4, memory.HUGE_MIN // 4 // 4 + 1000)  # a float32 result above the size that gets its own mapping
    prefetch.warm_results(shape, torch.float32, count=2)
    kept = memory.PAGES.kept_bytes()
    assert kept >= 2 * shape[0] * shape[1] * 4
    first, second = memory.empty_result(shape, torch.float32, "cpu"), memory.empty_result(shape, torch.float32, "cpu")
    assert memory.PAGES.kept_bytes() == kept - 2 * (kept // 2), "both results took a warmed mapping"
    del first, second


def test_a_small_result_is_warmed_harmlessly():
    prefetch.warm_results((2, 3), torch.float32)


@pytest.mark.skipif(not memory.OWN_MAPPINGS, reason="results in mappings of their own: Linux only")
def test_warming_gives_way_to_an_input():
    shape = (4, 3 * prefetch.WARM_STEP_BYTES // 4 // 4)  # three steps a result
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("an input came")

    with pytest.raises(RuntimeError, match="an input came"):
        prefetch.warm_results(shape, torch.float32, count=2, check=check)
    assert len(calls) == 2, "checked after each step, stopped at once"
    assert memory.PAGES.kept_bytes() >= 2 * shape[0] * shape[1] * 4, "what was written is kept"
