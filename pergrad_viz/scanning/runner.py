"""How a scan's work is shared and walked: the processes of a ``torch.distributed`` group, the chunks each one
takes, and the loop that computes a process's batches and writes their rows.

Rank r takes pending chunks r, r + W, r + 2W, ... (:func:`my_batches`: no example twice, no padding) and walks
them with a ``DataLoader`` in batches that never straddle a chunk (:func:`run`). Rank 0 prepares the scan's
directory; the other processes learn the outcome, an error included (:func:`prepare_on_rank_zero`; errors cross
processes as themselves, :mod:`pergrad_viz.scanning.remote`). Without a process group, (rank, world) is (0, 1)
and nothing is sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import tree_map

from pergrad_viz.api import resolve_strategy
from pergrad_viz.core.guards import autocast_dtype
from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.progress import progress_bar
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.scanning import remote, store
from pergrad_viz.scanning.compute import GRAD_QUANTITIES, batch_quantities
from pergrad_viz.scanning.sketch import GradientSketch, layer_blocks

SYNC_SECONDS = 2.0
"""Finished chunks are flushed to disk and marked done together, at most this often (and at the end): the
flush (msync) costs milliseconds, so a fast scan does not pay it per chunk. A killed process loses the
chunks finished since the last sync and the one in flight."""


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group, or (0, 1) without one."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def broadcast(obj: object, world: int) -> object:
    """Rank 0's ``obj`` on every process."""
    if world == 1:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def gather(obj: object, world: int) -> list:
    """Every process's ``obj``, in rank order, on every process."""
    if world == 1:
        return [obj]
    boxes: list = [None] * world
    torch.distributed.all_gather_object(boxes, obj)
    return boxes


def barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def prepare_on_rank_zero(rank: int, world: int, core: dict, prepare: Callable[[], tuple[dict, set[int]]]
                         ) -> tuple[dict | None, list[int]]:
    """Rank 0 checks that every process sees the same ``core`` (the manifest's fields that must match) and runs
    ``prepare`` (create the directory or check it holds this scan); every rank learns the chunks already done, or
    raises rank 0's error. Returns (the manifest on rank 0, None elsewhere; the chunks done, sorted)."""
    peers = gather(core, world)
    error: Exception | None = None
    manifest = None
    status: tuple[dict | None, list[int]] = (None, [])
    if rank == 0:
        try:
            refused = [(r, c["error"]) for r, c in enumerate(peers) if set(c) == {"error"}]
            if refused:  # a process whose arguments were refused (failed_before_prepare): everyone raises its error
                raise remote.rebuild_error(refused[0][1], f"process {refused[0][0]} refused the scan")
            bad = [r for r, c in enumerate(peers) if c != core]
            if bad:
                fields = sorted(k for k in {*core, *peers[bad[0]]} if core.get(k) != peers[bad[0]].get(k))
                raise ValueError(f"process(es) {bad} see a different model, dataset or settings than rank 0 (they "
                                 f"differ in {', '.join(fields)}): give every process the same model weights, dataset "
                                 "and arguments")
            manifest, done = prepare()
            status = (None, sorted(done))
        except Exception as exc:
            if world == 1:
                raise
            error, status = exc, (remote.error_report(exc), [])
    report, done_list = broadcast(status, world)
    if error is not None:
        raise error  # rank 0: the original exception, with its traceback
    if report is not None:
        raise remote.rebuild_error(report)  # the same exception where it can be carried, rank 0's traceback chained
    return manifest, done_list


def failed_before_prepare(rank: int, world: int, exc: Exception) -> None:
    """This process's scan was refused before the first exchange (a Dropout in training mode on this rank alone): it
    joins :func:`prepare_on_rank_zero`'s exchange marked as failed, so that the others raise its error too instead
    of waiting on it until the process group's timeout; the caller then raises its own."""
    report = remote.error_report(exc)
    gather({"error": report}, world)
    broadcast((report, []) if rank == 0 else None, world)


def my_batches(done: list[int], count: int, chunk_size: int, batch_size: int, n: int, rank: int, world: int
               ) -> list[list[int]]:
    """This process's batches of indices: every ``world``-th pending chunk from ``rank`` on, cut into batches of
    ``batch_size`` that never straddle a chunk."""
    pending = [c for c in range(count) if c not in set(done)]
    mine = pending[rank::world]
    return [list(range(s, min(s + batch_size, (c + 1) * chunk_size, n)))
            for c in mine for s in range(c * chunk_size, min((c + 1) * chunk_size, n), batch_size)]


def run(model: nn.Module, trainable: Trainable, loss_fn: LossFn, dataset: object, out: Path, manifest: dict,
        wanted: list[str], sketch: GradientSketch | None, batches: list[list[int]], chunk_size: int,
        num_workers: int, progress: bool, rank: int, world: int) -> tuple[float, int]:
    """This process's share: compute ``batches``, write rows, mark chunks done. Returns (seconds, rows)."""
    if not batches:
        return 0.0, 0
    arrays = store.open_arrays(out, manifest["arrays"])
    blocks = layer_blocks(trainable)
    want = set(wanted)
    device, dtype = trainable.device, trainable.dtype
    loader = data_loader(dataset, batches, num_workers, pin_memory=device.type == "cuda")
    total = sum(len(b) for b in batches)
    n = next(iter(manifest["arrays"].values()))["shape"][0]
    bar = progress_bar(total=total, unit="ex", unit_scale=True, disable=not progress, dynamic_ncols=True,
                       desc="scan" if world == 1 else f"scan (rank 0 of {world})")
    use_hooks = None
    pending: list[int] = []  # finished chunks not yet flushed and marked
    start = last_sync = time.perf_counter()

    def sync() -> None:
        nonlocal last_sync
        if not pending:
            return
        for a in arrays.values():
            a.flush()
        finished = pending.copy()
        pending.clear()
        for c in finished:
            store.mark_done(out, c)
        if rank == 0:
            store.refresh_manifest(out, manifest)
        last_sync = time.perf_counter()

    try:
        for indices, item in zip(batches, loader, strict=True):
            if isinstance(item, remote.WorkerFailure):
                item.reraise()
            x, y = _inputs_and_labels(item)
            x = tree_map(lambda t: _to(t, device, dtype), x)
            y = y.to(device, non_blocking=True) if isinstance(y, torch.Tensor) else torch.as_tensor(y, device=device)
            if use_hooks is None or use_hooks and want & GRAD_QUANTITIES:  # a failed check may have refused hooks
                use_hooks = not want & GRAD_QUANTITIES or _hooks_ok(trainable, x)
            res = batch_quantities(model, loss_fn, x, y, want, blocks, sketch, use_hooks)
            lo, hi = indices[0], indices[-1] + 1
            for q in wanted:
                arrays[q][lo:hi] = res[q].detach().cpu().numpy()
            bar.update(len(indices))
            if hi % chunk_size == 0 or hi == n:  # the last batch of chunk (hi - 1) // chunk_size
                pending.append((hi - 1) // chunk_size)
                if time.perf_counter() - last_sync >= SYNC_SECONDS:
                    sync()
    finally:
        sync()  # finished chunks are kept even when a later one fails
        bar.close()
    return time.perf_counter() - start, total


def _inputs_and_labels(item: object) -> tuple[object, object]:
    """A collated batch as (inputs, labels): ``(x, y, ...)``, or a dict whose ``labels`` are the targets and whose
    other entries the model's keyword arguments (as a Hugging Face dataset yields them)."""
    if isinstance(item, Mapping):
        inputs = {k: v for k, v in item.items() if k != "labels"}
        return inputs, item["labels"]
    return item[0], item[1]


def _to(t: object, device: torch.device, dtype: torch.dtype) -> object:
    """A tensor of a batch on ``device``, floating ones in the model's ``dtype``."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.to(device, non_blocking=True)
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def data_loader(dataset: torch.utils.data.Dataset, batches: list[list[int]], num_workers: int = 0,
                pin_memory: bool = False) -> torch.utils.data.DataLoader:
    """The ``DataLoader`` a scan walks: exactly these batches of indices, in order. A plain ``TensorDataset``
    is served a batch at a time (one indexing per tensor instead of one ``dataset[i]`` per example). With
    ``num_workers`` a batch whose loading failed arrives as a :class:`~pergrad_viz.scanning.remote.WorkerFailure`
    (its ``reraise()`` raises the worker's exception as itself), not as torch's ``type(message)``."""
    plain = torch.utils.data.TensorDataset
    served, collate = dataset, stacked
    if isinstance(dataset, plain) and type(dataset).__getitem__ is plain.__getitem__:
        served, collate = _Batches(dataset.tensors), remote.first
    if num_workers > 0:
        served = remote.GuardedBatches(served, collate)
        collate = remote.first
    # its own generator: a DataLoader draws its workers' base seed from the global RNG, which is the caller's
    return torch.utils.data.DataLoader(served, batch_sampler=batches, num_workers=num_workers, collate_fn=collate,
                                       pin_memory=pin_memory, generator=torch.Generator().manual_seed(0))


def stacked(items: list) -> object:
    """torch's default collate; where the examples differ in length, its error with a note naming the fix."""
    try:
        return torch.utils.data.default_collate(items)
    except RuntimeError as e:
        if "stack expects each tensor to be equal size" in str(e):
            e.add_note("pergrad_viz: pv.scan stacks a batch's examples as they are (torch's default collate), and "
                       "these differ in length: pad every example to one length in the dataset (with an attention_mask "
                       "where the model reads one), or pass batch_size=1")
        raise


class _Batches(torch.utils.data.Dataset):
    """A TensorDataset's tensors served a batch at a time (``__getitems__``): the same batch the default
    collate would build from its items, from one indexing per tensor."""

    def __init__(self, tensors: tuple[torch.Tensor, ...]):
        self.tensors = tensors

    def __len__(self) -> int:
        return self.tensors[0].shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        return tuple(t[i] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> list[tuple[torch.Tensor, ...]]:
        index = torch.as_tensor(indices)
        return [tuple(t[index] for t in self.tensors)]


def _hooks_ok(trainable: Trainable, x: object) -> bool:
    if autocast_dtype(trainable.device) is not None:  # the layer rules do not follow autocast: per_sample_grads does
        return False
    with restoring_modes(trainable):
        return resolve_strategy("auto", trainable, x) == "hooks"
