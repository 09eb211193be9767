"""The allocation of large results (pergrad_viz.core.memory.empty_result): a plain tensor of the right shape, dtype and
device, writable, freed when dropped, advised to transparent huge pages where the kernel gives them on request,
and a plain torch.empty wherever it cannot be."""

from __future__ import annotations

import gc
import os
import re

import pytest
import torch

from pergrad_viz.core import memory

MADVISE_MODE = os.path.exists(memory._THP_MODE) and "[madvise]" in open(memory._THP_MODE).read()
LARGE = (64, 100_000)  # 25.6 MB of float32: well above HUGE_MIN


def _vm_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping of this process that holds ``address`` (None: no mapping holds it)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head[1], 16) <= address < int(head[2], 16)
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [LARGE, (3, 5), (4, 10, 70_000)])
def test_a_result_has_its_shape_dtype_device_and_holds_what_is_written(shape, dtype):
    t = memory.empty_result(shape, dtype, "cpu")
    assert (tuple(t.shape), t.dtype, t.device.type) == (shape, dtype, "cpu")
    assert t.is_contiguous() and t.requires_grad is False
    values = torch.arange(t.numel(), dtype=torch.float64).remainder(251).to(dtype).reshape(shape)
    t.copy_(values)
    assert torch.equal(t, values)
    t[..., 0] = -1  # views write through, as the strategies write their rows
    assert (t[..., 0] == -1).all() and torch.equal(t[..., 1:], values[..., 1:])


@pytest.mark.skipif(not MADVISE_MODE, reason="transparent huge pages are not in madvise mode here")
def test_a_large_cpu_result_is_advised_to_huge_pages():
    """(That the advice stays inside the storage is tested on the call itself below: the flags of the pages around
    it depend on what the process allocated and advised before, e.g. an earlier result in the same mapping.)"""
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    start, nbytes = t.data_ptr(), t.numel() * 4
    first = -(-start // memory.HUGE_PAGE) * memory.HUGE_PAGE
    assert "hg" in _vm_flags(first)  # the kernel records the advice on the mapping (MADV_HUGEPAGE)
    assert "hg" in _vm_flags((start + nbytes) // memory.HUGE_PAGE * memory.HUGE_PAGE - 1)
    t.fill_(1.0)
    assert float(t.sum()) == t.numel()


@pytest.mark.skipif(not MADVISE_MODE, reason="transparent huge pages are not in madvise mode here")
def test_the_advised_range_is_aligned_and_inside_the_storage(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda: lambda lo, size, advice: calls.append((lo, size, advice)) or 0)
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    ((lo, size, advice),) = calls
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    assert lo % memory.HUGE_PAGE == 0 and size % memory.HUGE_PAGE == 0 and size > 0
    assert start <= lo and lo + size <= end and lo - start < memory.HUGE_PAGE and end - (lo + size) < memory.HUGE_PAGE
    assert advice == 14  # MADV_HUGEPAGE


def test_small_results_are_not_advised(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    t = memory.empty_result((8, 1000), torch.float32, "cpu")
    assert calls == [] and tuple(t.shape) == (8, 1000)


def test_without_madvise_it_is_a_plain_empty_tensor(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", lambda: None)
    t = memory.empty_result(LARGE, torch.float64, "cpu")
    assert (tuple(t.shape), t.dtype) == (LARGE, torch.float64)
    t.fill_(2.0)
    assert float(t[-1, -1]) == 2.0
    assert memory.advise_huge_pages(t) is False


def test_a_refusal_by_the_kernel_leaves_a_usable_tensor(monkeypatch):
    monkeypatch.setattr(memory, "_madvise", lambda: lambda *args: -1)
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    assert memory.advise_huge_pages(t) is False
    t.fill_(3.0)
    assert float(t.mean()) == 3.0


def test_other_devices_are_never_advised(monkeypatch):
    """A non-CPU tensor (meta here; CUDA below where there is one) is allocated as torch.empty and not advised."""
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    t = memory.empty_result(LARGE, torch.float32, "meta")
    assert (t.device.type, tuple(t.shape)) == ("meta", LARGE) and calls == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_result_is_a_cuda_tensor(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "_madvise", lambda: lambda *args: calls.append(args) or 0)
    t = memory.empty_result(LARGE, torch.float32, torch.device("cuda"))
    t.fill_(1.0)
    assert t.device.type == "cuda" and float(t.sum()) == t.numel() and calls == []


def test_dropped_results_are_freed():
    """Twenty 51 MB results (above glibc's largest mmap threshold, so each is its own mapping) allocated, filled
    and dropped one after another: the memory goes back each time."""
    shape = (64, 200_000)
    gc.collect()
    before = _rss_bytes()
    for _ in range(20):
        t = memory.empty_result(shape, torch.float32, "cpu")
        t.fill_(1.0)
        del t
    gc.collect()
    assert _rss_bytes() - before < 2 * shape[0] * shape[1] * 4  # twenty held would be 1 GB


def test_a_large_fresh_result_from_the_api_holds_the_per_sample_gradients():
    """per_sample_grads allocates its result with empty_result: a 26 MB flat result, row by row equal to the loop."""
    from helpers import ref_grads
    from torch import nn

    import pergrad_viz as pv

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 10))
    x, y = torch.randn(16, 784), torch.randint(0, 10, (16,))
    flat = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, flat=True)
    assert flat.numel() * 4 >= memory.HUGE_MIN
    want = torch.cat([g.reshape(16, -1) for g in ref_grads(model, nn.CrossEntropyLoss(), x, y).values()], dim=1)
    for i in range(16):
        torch.testing.assert_close(flat[i], want[i], rtol=1e-4, atol=1e-6)
