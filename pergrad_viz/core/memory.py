"""Memory estimates, checked before anything large is allocated; the allocation of large results."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import os
from collections.abc import Callable

import torch

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


def check_budget(*, what: str, result: int, working: int, max_bytes: int | None, allocate_result: bool,
                 device: torch.device, batch: int, chunk: int) -> None:
    """Raise :class:`MemoryBudgetError` when result (if allocated here) + working memory exceed the budget."""
    need = (result if allocate_result else 0) + working
    if max_bytes is None and need <= SMALL:
        return
    budget = default_budget(device) if max_bytes is None else int(max_bytes)
    if need <= budget:
        return
    per_sample = max(1, need // max(batch, 1))
    fits = budget // per_sample
    origin = "max_bytes" if max_bytes is not None else f"{BUDGET_SHARE:.0%} of the memory available on {device}"
    raise MemoryBudgetError(
        f"{what} would need about {human_bytes(need)} (result {human_bytes(result)}"
        f"{'' if allocate_result else ', in your out= buffer'}, working memory {human_bytes(working)} "
        f"for chunks of {chunk}), more than the budget of {human_bytes(budget)} ({origin}). "
        f"Use a smaller batch (about {fits} samples fit), pass chunk_size= to bound the working memory, "
        "freeze parameters you do not need (requires_grad_(False)), or call per_sample_grad_norms if norms "
        "are all you need; flat=False does not help here (results are written in place either way). "
        "If you know the memory is there, raise max_bytes=."
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
HUGE_MIN = 4 * HUGE_PAGE  # below this a result gains too little from huge pages to pay the system call
_THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` where transparent huge pages are given only to memory that asks (mode ``madvise``);
    None elsewhere: under ``always`` every large allocation has them already, under ``never`` none can, and on
    systems without the file or libc's symbol there is nothing to ask."""
    try:
        with open(_THP_MODE) as f:
            if "[madvise]" not in f.read():
                return None
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask the kernel to back ``tensor``'s memory (its 2 MiB-aligned interior) with transparent huge pages.

    Writing a freshly allocated result faults in one 4 KiB page at a time: filling 104 MB took 57 ms on a machine
    where the same fill took 6.6 ms once the memory was backed by huge pages (512 times fewer faults). Only memory
    the allocator has not handed out before benefits (the advice applies to pages faulted in after it), so call it
    right after ``torch.empty``. Returns whether the advice was given (False: a CUDA or small tensor, a system
    without ``madvise`` mode, or a refusal by the kernel; the tensor is unchanged and usable either way)."""
    fn = _madvise()
    nbytes = tensor.untyped_storage().nbytes()
    if fn is None or tensor.device.type != "cpu" or nbytes < HUGE_MIN:
        return False
    start = tensor.untyped_storage().data_ptr()
    lo = -(-start // HUGE_PAGE) * HUGE_PAGE  # inside the storage only: no other allocation's pages are touched
    hi = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    return hi > lo and fn(lo, hi - lo, getattr(mmap, "MADV_HUGEPAGE", 14)) == 0


def empty_result(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.empty(shape, dtype=dtype, device=device)``, a plain tensor, backed by transparent huge pages where
    that is cheaper to fill: large CPU results under the ``madvise`` mode (see :func:`advise_huge_pages`).

    Measured on a 104 MB (64, 407,050) float32 result, 2 threads: allocate and fill 170 ms (page faults) against
    36 ms advised, 27 ms to refill memory already faulted in."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if math.prod(shape) * dtype.itemsize >= HUGE_MIN:
        advise_huge_pages(tensor)
    return tensor
