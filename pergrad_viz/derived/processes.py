"""The clipped sum over several processes (``torch.distributed``: torchrun, gloo on CPU, NCCL on CUDA): each process
clips its own samples (possibly none: Poisson sampling draws empty batches), one small all-reduce counts the samples
and checks that every process passed the same model and the same clipping, one all-reduce adds the sums.

Every process takes the same collectives in the same order whatever its batch, so that none waits on another."""

from __future__ import annotations

import zlib

import torch


def check_distributed(distributed: object, stepped: object = None) -> None:
    """Refuse ``distributed=True`` outside an initialised ``torch.distributed`` process group, and ``dp_step`` on a
    ``DistributedDataParallel`` model (``stepped``) of several processes without it: ``.grad`` is written directly,
    so DDP's gradient all-reduce never runs and each process would step on its own samples alone."""
    if not isinstance(distributed, bool):
        raise TypeError(f"distributed must be True or False, got {distributed!r}")
    initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed and not initialised:
        raise ValueError("distributed=True needs torch.distributed initialised: run under torchrun and call "
                         "torch.distributed.init_process_group('gloo') (or 'nccl') first")
    if (not distributed and initialised and isinstance(stepped, torch.nn.parallel.DistributedDataParallel)
            and torch.distributed.get_world_size() > 1):
        raise ValueError("the model is wrapped in DistributedDataParallel, whose gradient all-reduce dp_step does not "
                         "run (it writes .grad itself): each process would step on its own samples alone and the "
                         "replicas would drift apart. Pass distributed=True on every process (the clipped sums are "
                         "all-reduced, the noise drawn once)")


def agreed_count(batch: int, shapes: list[tuple], clipping: tuple) -> int:
    """The number of samples of every process together, from one all-reduce of 4 float64 numbers (B, f, f^2, where
    f fingerprints this process's trainable parameters ``shapes`` [(name, shape, dtype, device)] and ``clipping``,
    and a failure count of 0): ValueError on every process where the processes passed different models or
    clipping (their sums would be added as if they were one model's); :class:`RuntimeError` where another
    process failed (:func:`failed_together`)."""
    described = repr([(n, tuple(s), str(d)) for n, s, d, _ in shapes] + [clipping]).encode()
    mark = zlib.crc32(described) % (1 << 20) + 1  # the same in every process (Python's hash() of a str is not)
    count, marks, squares, failures = _all_reduced([batch, mark, mark * mark, 0])
    if failures:
        raise RuntimeError(
            f"distributed=True: {failures} other process(es) raised an error in this step (see their output); this "
            "process raises too, so that none waits on the others"
        )
    world = torch.distributed.get_world_size()
    if marks * marks != world * squares:  # equal only where every process's mark is the same (Cauchy-Schwarz)
        raise ValueError(
            f"distributed=True: the processes passed different {_differing(shapes, clipping, world)}; every process "
            "must pass the same, each with its own samples (the weights are not compared: start every process from "
            "the same ones)"
        )
    return count


def _differing(shapes: list[tuple], clipping: tuple, world: int) -> str:
    """What differs between the processes (every one asks, on the failure path alone: one all_gather_object), with
    each process's value where short: ``trainable parameters (names, shapes, dtypes)``, ``clipping (...)``."""
    mine = {"trainable parameters (names, shapes and dtypes)": [(n, tuple(s), str(d)) for n, s, d, _ in shapes],
            "clipping (bounds per parameter group, the noise's std, dp_step's expected_batch_size)": clipping}
    every: list = [None] * world
    torch.distributed.all_gather_object(every, mine)
    parts = []
    for what, value in mine.items():
        if any(other[what] != value for other in every):
            shown = "; ".join(f"rank {r}: {other[what]!r:.120}" for r, other in enumerate(every))
            parts.append(f"{what} ({shown})")
    return " and ".join(parts) or "models or clipping"


class failing_together:  # noqa: N801 (used as a function: ``with failing_together(distributed):``)
    """Under ``distributed`` (checked by :func:`check_distributed`), an error raised inside (an argument check, this
    process's part of the step) joins :func:`agreed_count`'s all-reduce marked as failed before it is raised, so that
    the other processes raise too instead of pairing their next call with this one's. (A class: a generator-based
    context manager costs microseconds on every call.)"""

    def __init__(self, distributed: bool):
        self.distributed = distributed

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None and self.distributed and isinstance(error, Exception):
            failed_together()
        return False


def failed_together() -> None:
    """A process whose own part of the step raised joins :func:`agreed_count`'s all-reduce, marked as failed, so
    that the others raise too instead of waiting on it (the caller then raises its own error)."""
    _all_reduced([0, 0, 0, 1])


def _all_reduced(numbers: list[int]) -> list[int]:
    """The sums over every process of a few integers (one all-reduce of float64: exact below 2^53), on the CPU or,
    under NCCL, this process's GPU."""
    nccl = "nccl" in str(torch.distributed.get_backend()).lower()
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    t = torch.tensor(numbers, dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t)
    return [int(v) for v in t.tolist()]


def all_reduce_sums(sums: dict[str, torch.Tensor]) -> None:
    """Sum every process's ``sums`` in place, in one all-reduce of one flat buffer."""
    if not sums:
        return
    flat = torch.cat([t.reshape(-1) for t in sums.values()])
    torch.distributed.all_reduce(flat)
    for t, part in zip(sums.values(), flat.split([t.numel() for t in sums.values()]), strict=True):
        t.copy_(part.view(t.shape))
