"""Memory estimates, checked before anything large is allocated; the allocation of large results."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
import sys
import threading
import weakref

import torch

from pergrad_viz.core.numbers import real_number
from pergrad_viz.errors import MemoryBudgetError, human_bytes

BUDGET_SHARE = 0.5  # of the memory available when the call starts
SMALL = 64 * 2**20  # below this, a call does not look up the free memory (it costs more than small calls)


def available_bytes(device: torch.device) -> int:
    """Memory free for new tensors on ``device``: MemAvailable on CPU, free device memory on CUDA."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    pages = os.sysconf("SC_AVPHYS_PAGES") if hasattr(os, "sysconf") else 0
    return int(pages * os.sysconf("SC_PAGE_SIZE")) if pages else 8 * 2**30


def default_budget(device: torch.device) -> int:
    """The default ``max_bytes``: half of the memory available on ``device`` now."""
    return int(available_bytes(device) * BUDGET_SHARE)


def result_bytes(batch: int, num_params: int, dtype: torch.dtype, outputs: int = 1) -> int:
    """Bytes of a (B, P) per-sample gradient result, or of a (B, Y, P) Jacobian when ``outputs`` = Y."""
    return batch * outputs * num_params * dtype.itemsize


def budget_for(max_bytes: int | None, device: torch.device, need: int) -> int:
    """The budget ``need`` bytes are held to: ``max_bytes``, else :func:`default_budget` (``need`` itself where it is
    at most :data:`SMALL`: no look-up of the free memory)."""
    if max_bytes is not None:
        return int(real_number("max_bytes", max_bytes, hint=" (a budget in bytes) or None"))
    return need if need <= SMALL else default_budget(device)


def check_budget(*, what: str, result: int, working: int, max_bytes: int | None, allocate_result: bool,
                 device: torch.device, batch: int, chunk: int) -> None:
    """Raise :class:`MemoryBudgetError` when result (if allocated here) + working memory exceed the budget."""
    need = (result if allocate_result else 0) + working
    budget = budget_for(max_bytes, device, need)
    if need <= budget:
        return
    raise MemoryBudgetError(_over_budget(what=what, result=result, working=working, budget=budget,
                                         given=max_bytes is not None, allocate_result=allocate_result,
                                         device=device, batch=batch, chunk=chunk))


def _over_budget(*, what: str, result: int, working: int, budget: int, given: bool, allocate_result: bool,
                 device: torch.device, batch: int, chunk: int) -> str:
    """The message of :func:`check_budget`: the estimate, the budget, what one sample takes, and what to change."""
    need = (result if allocate_result else 0) + working
    batch, chunk = max(batch, 1), max(chunk, 1)
    row = (result if allocate_result else 0) / batch  # one sample's row of the result
    per_chunk_sample = working / chunk  # the working memory grows with the chunk, not with the batch
    origin = "max_bytes" if given else f"{BUDGET_SHARE:.0%} of the memory available on {device}"
    one = row + per_chunk_sample
    sizes = [f"its row of the result {human_bytes(row)}"] if allocate_result else []
    if working:
        sizes.append(f"working memory {human_bytes(per_chunk_sample)} per sample of a chunk")
    fixes = []
    room = budget - row * batch  # what the working memory may take
    fit = int(room // per_chunk_sample) if working and room > 0 else 0
    if 1 <= fit < chunk:
        fixes.append(f"pass chunk_size={fit}" + (" or less" if fit > 1 else "") + " to bound the working memory")
    if one > budget:
        fixes.append(f"a smaller batch or chunk_size= does not help: one sample alone needs about "
                     f"{human_bytes(one)}")
    elif row:  # n rows of the result and one chunk of one sample's working memory
        fixes.append(f"use a smaller batch (about {min(int((budget - per_chunk_sample) // row), batch - 1)} "
                     "samples fit" + (", with chunk_size=1)" if working else ")"))
    fixes.append(f"raise max_bytes= to {need} or more if you know the memory is there" if given else
                 f"pass max_bytes={need} or more if you know the memory is there")
    fixes.append("freeze parameters you do not need (requires_grad_(False)), or call per_sample_grad_norms if "
                 "norms are all you need; flat=False does not help (results are written in place either way)")
    return (
        f"{what} would need about {human_bytes(need)} (result {human_bytes(result)}"
        f"{'' if allocate_result else ', in your out= buffer'}, working memory {human_bytes(working)} "
        f"for chunks of {chunk}), more than the budget of {human_bytes(budget)} ({origin}). "
        f"One sample takes about {human_bytes(one)} ({', '.join(sizes) or 'working memory only'}). "
        "To fix: " + "; ".join(fixes) + "."
    )


def check_held(*, what: str, held: int, detail: str, fix: str, device: torch.device) -> None:
    """Raise :class:`MemoryBudgetError` when ``held`` bytes, several results held at once by a tool built on the
    package (e.g. the explorer: its heatmap's gradients plus the results compared while timing), exceed the same
    budget as a call's (:data:`BUDGET_SHARE` of the memory available on ``device``). ``detail`` says what is held,
    ``fix`` what to change."""
    if held <= SMALL:
        return
    budget = default_budget(device)
    if held <= budget:
        return
    raise MemoryBudgetError(
        f"{what} would hold about {human_bytes(held)} ({detail}), more than the budget of {human_bytes(budget)} "
        f"({BUDGET_SHARE:.0%} of the memory available on {device}). {fix}"
    )


HUGE_PAGE = 2 * 2**20  # x86-64 and arm64 (4 KiB base pages): the transparent huge page size
HUGE_MIN = 4 * HUGE_PAGE  # results from this size get their own mapping (below it, torch.empty: glibc's heap)
KEEP_BYTES = 2 * 2**30  # at most this much memory of dropped results is kept for the next results
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _thp_on_request() -> bool:
    """Whether transparent huge pages are given only to memory that asks (mode ``madvise``): under ``always``
    every large mapping has them already, under ``never`` none can."""
    try:
        with open(_THP_MODE) as f:
            return "[madvise]" in f.read()
    except OSError:
        return False


def _address(mapping: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))  # the temporary export ends with the ctypes object


class ResultPages:
    """Private anonymous mappings for large CPU results, 2 MiB-aligned and advised to transparent huge pages, and
    the mappings of dropped results kept for the next results of the same size (reused, they are written without a
    page fault or the kernel's zero fill).

    Writing a fresh result faults in its pages, each zero-filled by the kernel first (times in :func:`empty_result`:
    2.2x a refill in huge pages, 10x in 4 KiB pages); torch.empty's allocation, glibc's, starts 16 bytes into its
    mapping, which leaves its first and last 2 MiB in 4 KiB pages. A dropped result's mapping is marked
    ``MADV_FREE``: its pages stay mapped, but the kernel may take them back whenever it needs memory (they count as
    available in MemAvailable, and as LazyFree in /proc/self/smaps); what it took comes back zero-filled on the
    next write. At most :data:`KEEP_BYTES` are kept, the oldest let go first; :meth:`release` lets all of them go
    now."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # reentrant: a collection inside take() may drop a result (put())
        self._free: list[mmap.mmap] = []  # oldest first

    def kept_bytes(self) -> int:
        """Bytes of the mappings kept for reuse now."""
        with self._lock:
            return sum(len(m) for m in self._free)

    def take(self, nbytes: int) -> tuple[mmap.mmap, int]:
        """A mapping holding ``nbytes`` from a 2 MiB-aligned offset: ``(mapping, offset)``; a kept one if one has
        the size, else a new one (advised to huge pages under the ``madvise`` mode)."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # one page more: room to align the start
        with self._lock:
            kept = next((i for i, m in enumerate(self._free) if len(m) == size), None)
            mapping = self._free.pop(kept) if kept is not None else None
        if mapping is None:
            mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        offset = _aligned_offset(mapping)
        if kept is None and _thp_on_request():
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE, offset, size - HUGE_PAGE)
            except OSError:  # refused: the result is written in base pages
                pass
        return mapping, offset

    def put(self, mapping: mmap.mmap) -> None:
        """Keep the mapping of a dropped result for reuse (its pages marked free), or let it go."""
        try:
            mapping.madvise(mmap.MADV_FREE, _aligned_offset(mapping), len(mapping) - HUGE_PAGE)
        except OSError:  # a kernel without MADV_FREE: not kept (its pages would count as used memory)
            mapping.close()
            return
        with self._lock:
            self._free.append(mapping)
            total, evicted = sum(len(m) for m in self._free), []
            while total > KEEP_BYTES:
                evicted.append(self._free.pop(0))
                total -= len(evicted[-1])
        for m in evicted:
            m.close()

    def release(self) -> None:
        """Let every kept mapping go (unmapped now)."""
        with self._lock:
            free, self._free = self._free, []
        for m in free:
            m.close()


def _aligned_offset(mapping: mmap.mmap) -> int:
    start = _address(mapping)
    return -(-start // HUGE_PAGE) * HUGE_PAGE - start


PAGES = ResultPages()
if hasattr(os, "register_at_fork"):  # a child forked while another thread held the lock would wait for it forever
    os.register_at_fork(after_in_child=lambda: setattr(PAGES, "_lock", threading.RLock()))
# Where a result's memory is its own private anonymous mapping: Linux (MAP_ANONYMOUS, MADV_FREE in Python's mmap).
OWN_MAPPINGS = sys.platform.startswith("linux") and hasattr(mmap, "MADV_FREE") and hasattr(mmap, "MAP_ANONYMOUS")


def _mapped_tensor(shape: tuple[int, ...], dtype: torch.dtype, pages: ResultPages) -> torch.Tensor | None:
    """A contiguous ``shape`` tensor in a mapping from ``pages``; None where no mapping could be made."""
    nbytes = math.prod(shape) * dtype.itemsize
    try:
        mapping, offset = pages.take(nbytes)
    except OSError:  # e.g. out of address space: torch.empty then says so the way torch does
        return None
    view = memoryview(mapping)  # the storage holds this view; when the storage goes, so does the view and then
    raw = torch.frombuffer(view, dtype=torch.uint8, count=nbytes, offset=offset)  # the mapping goes back
    weakref.finalize(view, pages.put, mapping).atexit = False
    return torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), 0, shape)  # not a view: a tensor of its own


def empty_result(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, a plain contiguous tensor; a large CPU result (from
    :data:`HUGE_MIN` bytes, on Linux) in memory of its own: transparent huge pages, or the memory of a dropped
    result of the same size (see :class:`ResultPages`).

    Allocating and filling a 104 MB (64, 407,050) float32 result, 1 thread (CPU time), against filling memory
    already faulted in (4.5 ms): torch.empty 10x (25,441 faults), torch.empty advised to huge pages 2.5x (913: its
    first and last 2 MiB in 4 KiB pages), a new mapping here 2.2x (50), a reused one 0.9x (none)."""
    if torch.device(device).type != "cpu" or not OWN_MAPPINGS or math.prod(shape) * dtype.itemsize < HUGE_MIN:
        return torch.empty(shape, dtype=dtype, device=device)
    mapped = _mapped_tensor(tuple(shape), dtype, PAGES)
    return torch.empty(shape, dtype=dtype, device=device) if mapped is None else mapped
