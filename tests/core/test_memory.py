"""The allocation of large results (pergrad_viz.core.memory.empty_result): a plain tensor of the right shape, dtype and
device, writable; a large CPU result on Linux in a mapping of its own, aligned to and advised to transparent huge
pages, kept when dropped (lazily free) for the next result of its size, within a bound; a plain torch.empty wherever
it cannot be."""

from __future__ import annotations

import gc
import mmap
import os
import re
import threading

import pytest
import torch
from helpers import forked_result

from pergrad_viz.core import memory

MADVISE_MODE = os.path.exists(memory._THP_MODE) and "[madvise]" in open(memory._THP_MODE).read()
LARGE = (64, 100_000)  # 25.6 MB of float32: well above HUGE_MIN


def _smaps_line(address: int, field: str) -> list[str] | None:
    """The words after ``field:`` in /proc/self/smaps for the mapping of this process that holds ``address`` (None:
    no mapping holds it)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if head:
                inside = int(head[1], 16) <= address < int(head[2], 16)
            elif inside and line.startswith(f"{field}:"):
                return line.split()[1:]
    return None


def _vm_flags(address: int) -> list[str] | None:
    """The VmFlags of the mapping of this process that holds ``address`` (None: no mapping holds it)."""
    return _smaps_line(address, "VmFlags")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64])
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


ON_LINUX = memory.OWN_MAPPINGS
linux_only = pytest.mark.skipif(not ON_LINUX, reason="large results are plain torch.empty tensors here")


@pytest.fixture(autouse=True)
def _no_kept_pages():
    """Each test starts and ends with no mapping kept for reuse (a kept one would be reused across tests)."""
    memory.PAGES.release()
    yield
    gc.collect()
    memory.PAGES.release()


def _smaps_field(address: int, field: str) -> int | None:
    """A kB field (``Rss``, ``LazyFree``, ...) of the mapping of this process that holds ``address``."""
    words = _smaps_line(address, field)
    return None if words is None else int(words[0])


@linux_only
def test_a_large_result_is_a_plain_tensor_of_its_own_aligned_to_huge_pages():
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    assert t._base is None and t.is_contiguous() and t.storage_offset() == 0  # not a view of anything
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    assert t.untyped_storage().nbytes() == t.numel() * 4


@linux_only
@pytest.mark.skipif(not MADVISE_MODE, reason="transparent huge pages are not in madvise mode here")
def test_a_large_result_is_advised_to_huge_pages_from_its_first_byte_to_its_last():
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    start, nbytes = t.data_ptr(), t.numel() * 4
    assert "hg" in _vm_flags(start)  # the kernel records the advice on the mapping (MADV_HUGEPAGE)
    assert "hg" in _vm_flags(start + nbytes - 1)
    t.fill_(1.0)
    assert float(t.sum()) == t.numel()


@linux_only
def test_a_dropped_result_is_reused_by_the_next_of_its_size_its_pages_lazily_free_meanwhile():
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    t.fill_(7.0)
    address = t.data_ptr()
    del t
    assert memory.PAGES.kept_bytes() >= LARGE[0] * LARGE[1] * 4
    assert _smaps_field(address, "LazyFree") > 0  # the kernel may take these pages back whenever it needs memory
    other = memory.empty_result((64, 300_000), torch.float32, "cpu")  # another size: a mapping of its own
    assert other.data_ptr() != address
    again = memory.empty_result(LARGE, torch.float32, "cpu")
    assert again.data_ptr() == address and memory.PAGES.kept_bytes() == 0
    again.fill_(2.0)
    assert float(again.sum()) == 2.0 * again.numel() and _smaps_field(address, "LazyFree") == 0


@linux_only
def test_a_result_still_held_through_a_view_or_numpy_is_never_handed_out_again():
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    address = t.data_ptr()
    row, array = t[3], t[5:7].numpy()
    t.fill_(1.0)
    del t
    u = memory.empty_result(LARGE, torch.float32, "cpu")
    u.fill_(-1.0)
    assert u.data_ptr() != address and float(row.sum()) == row.numel() and (array == 1.0).all()
    del row
    v = memory.empty_result(LARGE, torch.float32, "cpu")
    assert v.data_ptr() != address  # the array still holds it
    del array
    w = memory.empty_result(LARGE, torch.float32, "cpu")
    assert w.data_ptr() == address


@linux_only
def test_results_alive_at_once_never_share_memory():
    held = [memory.empty_result(LARGE, torch.float32, "cpu") for _ in range(3)]
    for i, t in enumerate(held):
        t.fill_(float(i))
    assert [float(t[0, 0]) for t in held] == [0.0, 1.0, 2.0]
    assert len({t.data_ptr() for t in held}) == 3


@linux_only
def test_kept_memory_is_bounded_oldest_let_go_first_and_release_unmaps_it(monkeypatch):
    nbytes = LARGE[0] * LARGE[1] * 4
    monkeypatch.setattr(memory, "KEEP_BYTES", 2 * nbytes + 4 * memory.HUGE_PAGE)  # room for two
    held = [memory.empty_result(LARGE, torch.float32, "cpu") for _ in range(3)]
    addresses = [t.data_ptr() for t in held]
    while held:
        del held[0]  # dropped in order
    assert _vm_flags(addresses[0]) is None  # the oldest unmapped
    assert _vm_flags(addresses[1]) is not None and _vm_flags(addresses[2]) is not None
    memory.PAGES.release()
    assert memory.PAGES.kept_bytes() == 0 and _vm_flags(addresses[1]) is None and _vm_flags(addresses[2]) is None


@linux_only
def test_a_result_dropped_in_another_thread_goes_back():
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    address, box = t.data_ptr(), [t]
    del t
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert memory.empty_result(LARGE, torch.float32, "cpu").data_ptr() == address


def test_small_results_are_plain_empty_tensors():
    t = memory.empty_result((8, 1000), torch.float32, "cpu")
    assert tuple(t.shape) == (8, 1000) and t.untyped_storage().resizable()  # torch's own allocation
    del t
    assert memory.PAGES.kept_bytes() == 0


def test_without_own_mappings_it_is_a_plain_empty_tensor(monkeypatch):
    monkeypatch.setattr(memory, "OWN_MAPPINGS", False)
    t = memory.empty_result(LARGE, torch.float64, "cpu")
    assert (tuple(t.shape), t.dtype) == (LARGE, torch.float64) and t.untyped_storage().resizable()
    t.fill_(2.0)
    assert float(t[-1, -1]) == 2.0


@linux_only
def test_where_no_mapping_can_be_made_it_is_a_plain_empty_tensor(monkeypatch):
    def refuse(nbytes):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(memory.PAGES, "take", refuse)
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    assert tuple(t.shape) == LARGE and t.untyped_storage().resizable()
    t.fill_(4.0)
    assert float(t[0, 0]) == 4.0


@linux_only
def test_a_refused_huge_page_advice_leaves_a_usable_tensor(monkeypatch):
    monkeypatch.setattr(memory, "_thp_on_request", lambda: True)
    monkeypatch.setattr(mmap, "MADV_HUGEPAGE", -1)  # the kernel answers EINVAL
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    t.fill_(3.0)
    assert float(t.mean()) == 3.0


@linux_only
def test_without_madv_free_a_dropped_result_is_unmapped(monkeypatch):
    monkeypatch.setattr(mmap, "MADV_FREE", -1)  # a kernel without it answers EINVAL
    t = memory.empty_result(LARGE, torch.float32, "cpu")
    address = t.data_ptr()
    del t
    assert memory.PAGES.kept_bytes() == 0 and _vm_flags(address) is None


def test_other_devices_are_never_mapped():
    """A non-CPU tensor (meta here; CUDA below where there is one) is allocated as torch.empty."""
    t = memory.empty_result(LARGE, torch.float32, "meta")
    assert (t.device.type, tuple(t.shape)) == ("meta", LARGE)
    del t
    assert memory.PAGES.kept_bytes() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_result_is_a_cuda_tensor():
    t = memory.empty_result(LARGE, torch.float32, torch.device("cuda"))
    t.fill_(1.0)
    assert t.device.type == "cuda" and float(t.sum()) == t.numel()


def test_under_inference_mode_a_large_result_is_an_inference_tensor_like_torch_empty():
    with torch.inference_mode():
        t = memory.empty_result(LARGE, torch.float32, "cpu")
        plain = torch.empty(3)
    assert t.is_inference() == plain.is_inference()


def test_dropped_results_are_freed():
    """Twenty 51 MB results allocated, filled and dropped one after another: at most one is kept (each reuses the
    last one's memory), and none once the kept memory is released."""
    shape = (64, 200_000)
    gc.collect()
    before = _rss_bytes()
    for _ in range(20):
        t = memory.empty_result(shape, torch.float32, "cpu")
        t.fill_(1.0)
        del t
    gc.collect()
    assert _rss_bytes() - before < 2 * shape[0] * shape[1] * 4  # twenty held would be 1 GB
    memory.PAGES.release()
    assert _rss_bytes() - before < shape[0] * shape[1] * 4 // 2


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


def _kept_in_child(queue):
    from pergrad_viz.core.memory import PAGES

    queue.put(PAGES.kept_bytes())


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_child_forked_while_the_result_pages_are_locked_can_take_them():
    """Found by a review: a child forked while another thread held the result pages' lock inherited it held."""
    import threading

    from pergrad_viz.core.memory import PAGES

    held, leave = threading.Event(), threading.Event()

    def hold():
        with PAGES._lock:
            held.set()
            leave.wait(timeout=60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(timeout=30)
        assert forked_result(_kept_in_child) >= 0
    finally:
        leave.set()
        holder.join(timeout=30)
