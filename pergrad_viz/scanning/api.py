"""Whole-dataset scans: per-sample losses, gradient norms, EL2N scores and gradient sketches, written to disk
in dataset order, resumable, on one process or many (``torch.distributed``, e.g. under ``torchrun``).

Shapes: N examples in the dataset, L layers with trainable parameters, K = ``proj_dim``.

>>> scan = pv.scan(model, nn.CrossEntropyLoss(), dataset, quantities=("loss", "grad_norm", "el2n"),
...                out="runs/scan1")
>>> scan["grad_norm"]                     # (N,) float32, memory-mapped from runs/scan1/grad_norm.npy
>>> scan = pv.load_scan("runs/scan1")     # the same, later

Quantities (per example i, with the per-sample gradient G_i of ``loss_fn(model(x[i:i+1]), y[i:i+1])``):

============  ========  ==============================================================================
``loss``      (N,)      the loss of example i alone
``grad_norm`` (N,)      ||G_i||_2 over every trainable parameter (ghost norms where rules allow)
``layer_norms`` (N, L)  ||G_i||_2 restricted to each layer's own parameters (``scan.layers`` names them)
``el2n``      (N,)      ||softmax(logits_i) - onehot(y_i)||_2 (classifiers only)
``projection`` (N, K)   a seeded structured random projection of G_i (:mod:`pergrad_viz.scanning.sketch`):
                        dot products of rows estimate dot products of the gradients (TracIn, TRAK)
============  ========  ==============================================================================

How it runs: the indices 0..N-1 are cut into chunks of ``chunk_size`` examples (a multiple of
``batch_size``). Chunks not yet done are dealt to the processes in turn (rank r takes pending chunks r,
r + W, r + 2W, ...: no example twice, no padding), each process walks its chunks with a ``DataLoader`` in
batches that never straddle a chunk, writes its rows into the shared memory-mapped ``.npy`` files (rows are
disjoint), flushes them and then marks the chunk done (finished chunks are synced together, at most every
:data:`~pergrad_viz.scanning.runner.SYNC_SECONDS`; how the chunks are shared and walked:
:mod:`pergrad_viz.scanning.runner`). A killed run loses the chunk in flight and those finished since its last sync; a
rerun with the same ``out`` skips finished chunks (whatever the number of processes then). A rerun with
another model, dataset, loss or settings is refused (:class:`ScanMismatchError`; what is compared:
:func:`pergrad_viz.scanning.store.model_fingerprint`, :func:`~pergrad_viz.scanning.store.dataset_fingerprint`,
:func:`~pergrad_viz.scanning.store.loss_description`). Rank 0 creates the directory
and writes the manifest (after a barrier at the end). Because every chunk is computed in the same batches
whatever the number of processes, results with 1 and W processes agree (bit for bit on one machine).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from pergrad_viz.core.losses import LossFn
from pergrad_viz.core.numbers import whole_number
from pergrad_viz.core.process import leaves_process_as_found
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.core.validate import check_loss, check_modes
from pergrad_viz.scanning import remote, runner, store
from pergrad_viz.scanning.compute import SelectedLoss
from pergrad_viz.scanning.sketch import GradientSketch, layer_blocks
from pergrad_viz.scanning.store import ScanMismatchError

__all__ = ["QUANTITIES", "Scan", "ScanMismatchError", "load_scan", "scan"]

QUANTITIES: tuple[str, ...] = ("loss", "grad_norm", "layer_norms", "el2n", "projection")
"""Valid names for ``scan(quantities=...)``, in the order they are stored."""

class Scan(dict):
    """``{quantity: Tensor (N, ...)}`` memory-mapped (copy-on-write: editing a tensor never changes the files),
    with the scan's ``manifest`` (a dict) and ``layers`` (names of the ``layer_norms`` columns)."""

    def __init__(self, data: dict[str, torch.Tensor], manifest: dict):
        super().__init__(data)
        self.manifest = manifest

    @property
    def layers(self) -> list[str]:
        return list(self.manifest["settings"]["layers"])

    @property
    def complete(self) -> bool:
        return bool(self.manifest.get("complete"))

    def __missing__(self, quantity: str) -> torch.Tensor:
        raise KeyError(f"{quantity!r} is not in this scan: it holds {', '.join(map(repr, self))} (pass quantities= "
                       "to pv.scan, --quantities to the command, to scan others)")

    def __repr__(self) -> str:  # the quantities' shapes, not their (N, ...) numbers
        shapes = ", ".join(f"{q!r}: {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for q, t in self.items())
        return f"Scan({{{shapes}}}, complete={self.complete})"


def load_scan(out: str | Path, *, partial: bool = False) -> Scan:
    """The scan written to ``out`` by :func:`scan`: ``{quantity: Tensor (N, ...)}`` in dataset order, memory-mapped.

    Args:
        out: the directory given to :func:`scan` (or ``--out`` of ``python -m pergrad_viz scan``).
        partial: also load an unfinished scan (rows of chunks not done yet are NaN).

    Raises:
        FileNotFoundError: ``out`` does not exist or holds no scan (the message says what to pass).
        ValueError: a damaged or foreign manifest, or an unfinished scan without ``partial=True``.
    """
    out = Path(out)
    manifest = store.read_manifest(out)
    count = manifest["chunks"]["count"]
    done = set(manifest["chunks"]["done"]) | store.done_chunks(out)
    if len(done) < count and not partial:
        raise ValueError(
            f"the scan in {out} is unfinished: {len(done)} of {count} chunks done. Rerun the same scan (same "
            "model, dataset and settings, out= this directory) to finish it, or pass partial=True to load it "
            "with NaN rows where chunks are missing"
        )
    manifest["chunks"]["done"] = sorted(done)
    arrays = store.open_arrays(out, manifest["arrays"], mode="c")
    return Scan({q: torch.from_numpy(a) for q, a in arrays.items()}, manifest)


def _check_quantities(quantities: Sequence[str] | str, proj_dim: int | None) -> list[str]:
    if isinstance(quantities, str):
        quantities = [q.strip() for q in quantities.split(",") if q.strip()]
    bad = [q for q in quantities if q not in QUANTITIES]
    if bad or not quantities:
        raise ValueError(f"unknown quantities {bad}; valid: {', '.join(QUANTITIES)}" if bad
                         else f"quantities is empty; pass some of: {', '.join(QUANTITIES)}")
    wanted = set(quantities)
    if proj_dim is not None:
        wanted.add("projection")
    elif "projection" in wanted:
        raise ValueError("quantity 'projection' needs proj_dim: pass proj_dim=K (e.g. 256 columns per example)")
    return [q for q in QUANTITIES if q in wanted]


def _check_dataset(dataset: object) -> int:
    if isinstance(dataset, torch.utils.data.DataLoader):
        raise TypeError("scan takes the dataset, not a DataLoader (it batches the samples itself: batch_size=, "
                        "num_workers=): pass loader.dataset")
    if type(dataset) is tuple and len(dataset) == 2 and all(isinstance(t, torch.Tensor) for t in dataset):
        raise TypeError("scan takes a dataset of (input, label) pairs, got a tuple of two tensors: pass "
                        "torch.utils.data.TensorDataset(inputs, labels)")
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
        raise TypeError(
            f"scan needs a map-style dataset (len() and dataset[i]), got {type(dataset).__name__}: an iterable "
            "dataset has no fixed order to write rows in or resume from; wrap your data in a torch.utils.data.Dataset"
        )
    try:
        n = len(dataset)
    except TypeError:
        raise TypeError(f"scan needs a dataset with len(), got {type(dataset).__name__}") from None
    if n < 1:
        raise ValueError("the dataset is empty (len() == 0): there is nothing to scan")
    item = dataset[0]
    if isinstance(item, Mapping) and "labels" in item:
        return n
    if not isinstance(item, (tuple, list)) or len(item) < 2 or item[1] is None:
        got = type(item).__name__ if not isinstance(item, (tuple, list)) else f"a {type(item).__name__} of {len(item)}"
        raise ValueError(
            f"dataset[0] is {got}, not an (input, label) pair: per-sample losses need labels. Make the dataset "
            "yield (x, y), e.g. torch.utils.data.TensorDataset(inputs, labels), or dicts with a 'labels' entry"
        )
    return n


def _prepare(out: Path, new: dict) -> tuple[dict, set[int]]:
    """Rank 0: create ``out`` or check that it holds this very scan; returns (manifest, chunks done)."""
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out={str(out)!r} is a file, not a directory: pass a directory path for the scan")
    if store.manifest_path(out).exists():
        old = store.read_manifest(out)
        store.check_same_scan(out, old, new)
        store.open_arrays(out, old["arrays"])  # present and of the right shapes
        return old, set(old["chunks"]["done"]) | store.done_chunks(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} exists and is not empty, but holds no pergrad_viz scan ({store.MANIFEST} is missing): refusing "
            "to write into it. Pass a new or empty directory as out="
        )
    out.mkdir(parents=True, exist_ok=True)
    store.create_arrays(out, new["arrays"])
    store.write_manifest(out, new)
    return new, set()


def _arguments(model, loss_fn, dataset, quantities, batch_size, proj_dim, out, seed, chunk_size, num_workers,
               output) -> tuple:
    """:func:`scan`'s arguments checked (before anything is written): (quantities, batch size, N, chunk size, out,
    trainable, sketch, the new manifest, workers)."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "pv.scan was called under torch.inference_mode(), where the gradients it computes cannot be recorded and "
            "the tensors it is handed cannot be used for them: call it outside the inference_mode block (it records "
            "gradients itself and leaves the model's .grad untouched)")
    check_loss(loss_fn)
    if output is not None and not callable(output):
        raise TypeError(f"output= must be a callable picking a tensor from the model's output, e.g. "
                        f"output=lambda out: out.logits, got {type(output).__name__}")
    proj_dim = None if proj_dim is None else whole_number("proj_dim", proj_dim, hint=" (columns per example)")
    seed = whole_number("seed", seed, minimum=0)
    num_workers = whole_number("num_workers", num_workers, minimum=0)
    wanted = _check_quantities(quantities, proj_dim)
    batch_size = whole_number("batch_size", batch_size)
    n = _check_dataset(dataset)
    if chunk_size is None:
        chunk_size = batch_size * min(64, max(1, math.ceil(n / (16 * batch_size))))
    chunk_size = whole_number("chunk_size", chunk_size)
    if chunk_size % batch_size:
        raise ValueError(f"chunk_size={chunk_size} must be a multiple of batch_size={batch_size} "
                         f"(e.g. {batch_size * max(1, round(chunk_size / batch_size))})")
    if out is None:
        raise ValueError("out= is required: the directory the scan writes to")
    out = Path(out)
    trainable = Trainable.of(model)
    check_modes(trainable)
    sketch = GradientSketch(trainable, proj_dim, seed) if proj_dim is not None else None
    new = store.new_manifest(model, loss_fn, dataset, n, quantities=wanted, dtype=trainable.dtype,
                             layers=[b.label for b in layer_blocks(trainable)], proj_dim=proj_dim, seed=seed,
                             chunk_size=chunk_size, projection=sketch.describe() if sketch is not None else None)
    return wanted, batch_size, n, chunk_size, out, trainable, sketch, new, num_workers


@leaves_process_as_found
def scan(model: nn.Module, loss_fn: LossFn, dataset: torch.utils.data.Dataset, *,
         quantities: Sequence[str] | str = ("loss", "grad_norm"), batch_size: int = 256, proj_dim: int | None = None,
         out: str | Path, seed: int = 0, chunk_size: int | None = None, num_workers: int = 0,
         progress: bool = True, output: Callable[[object], torch.Tensor] | None = None) -> Scan:
    """Scan ``dataset`` with ``model`` and write per-example quantities to ``out``, in dataset order.

    Run it in every process of a ``torch.distributed`` group (e.g. under ``torchrun``) to share the work: each
    process computes its own chunks; every process returns the whole result.

    Args:
        model: the model, on the device to compute on; left as it was (no hooks, same parameters and modes).
            Call ``model.eval()`` first if it has Dropout or BatchNorm (refused in training mode).
        loss_fn: ``loss_fn(output, targets) -> scalar``, e.g. ``nn.CrossEntropyLoss()``.
        dataset: a map-style dataset yielding ``(x, y, ...)`` items (extra fields are ignored; ``x`` may be a
            tuple or dict of tensors, as :func:`pergrad_viz.per_sample_grads` takes inputs), or dicts whose
            ``labels`` entry holds the targets and whose other entries are the model's keyword arguments; floating
            inputs are cast to the model's dtype and moved to its device.
        quantities: some of ``"loss", "grad_norm", "layer_norms", "el2n", "projection"`` (:data:`QUANTITIES`; a
            sequence or a comma-separated string); ``projection`` is added when ``proj_dim`` is given.
        batch_size: examples per forward/backward pass.
        proj_dim: K, the width of the gradient sketch (:class:`pergrad_viz.scanning.sketch.GradientSketch`).
        out: the scan's directory: created if absent, continued if it holds this scan, refused otherwise.
        seed: seeds the projection (the same in every process).
        chunk_size: examples per resumable chunk, a multiple of ``batch_size`` (default: as many batches as
            make about 16 chunks, at most 64 batches).
        num_workers: ``DataLoader`` worker processes.
        progress: show a tqdm bar (examples per second) on rank 0.
        output: the tensor the loss (and EL2N) is of, picked from what the model returns, as in
            :func:`pergrad_viz.per_sample_jacobian`: ``output=lambda out: out.logits`` for a Hugging Face model and a
            ``torch.nn`` loss (the package's ``causal_lm_loss`` / ``sequence_classification_loss`` take the model
            output as it is). Default: the output itself.

    Returns:
        :class:`Scan`, as :func:`load_scan` gives: ``{quantity: Tensor (N, ...)}``, memory-mapped.

    Raises:
        ValueError / TypeError: bad arguments or a dataset without labels (before anything is written);
        :class:`ScanMismatchError` when ``out`` holds a different scan; FileExistsError when ``out`` is a
        non-empty directory that is not a scan; :class:`pergrad_viz.UnsupportedModelError` for Dropout or
        BatchNorm in training mode.
    """
    rank, world = runner.world()
    try:  # a refusal on one process alone is told to the others (they would wait on it in the exchange below)
        wanted, batch_size, n, chunk_size, out, trainable, sketch, new, num_workers = _arguments(
            model, loss_fn, dataset, quantities, batch_size, proj_dim, out, seed, chunk_size, num_workers, output)
    except Exception as e:
        if world > 1:
            runner.failed_before_prepare(rank, world, e)
        raise

    # Rank 0 prepares the directory; every rank learns the outcome (an error is raised everywhere).
    core = {**{k: new[k] for k in store.MUST_MATCH}, "batch_size": batch_size}  # the rows bit for bit as one process's
    existed, started = out.exists(), store.manifest_path(out).exists()
    manifest, done = runner.prepare_on_rank_zero(rank, world, core, lambda: _prepare(out, new))
    if rank != 0:
        manifest = store.read_manifest(out)

    batches = runner.my_batches(done, manifest["chunks"]["count"], chunk_size, batch_size, n, rank, world)
    scan_loss = loss_fn if output is None else SelectedLoss(loss_fn, output)
    failed: Exception | None = None
    try:
        seconds, rows = runner.run(model, trainable, scan_loss, dataset, out, manifest, wanted, sketch, batches,
                                   chunk_size, num_workers, progress and rank == 0, rank, world)
    except Exception as e:  # a quantity the model's output cannot give (el2n of a sequence), the model's own error
        if world == 1 and not started:  # this call made the directory and finished nothing: a retry starts afresh
            store.remove_unstarted(out, manifest, existed)
        if world == 1:
            raise
        failed, seconds, rows = e, 0.0, 0  # told to the others below (they would wait on it), then raised
    stats = runner.gather((seconds, rows, None if failed is None else remote.error_report(failed)), world)
    if failed is not None:
        raise failed
    reports = [(r, report) for r, (_, _, report) in enumerate(stats) if report is not None]
    if reports:  # another process's error, raised here as itself (its traceback chained); the chunks done are kept
        raise remote.rebuild_error(reports[0][1], f"process {reports[0][0]} of the scan failed")
    if rank == 0:
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
        run = {"started": now, "world_size": world, "batch_size": batch_size, "device": str(trainable.device),
               "threads": torch.get_num_threads(),
               "examples": sum(r for _, r, _ in stats), "seconds": round(max(s for s, _, _ in stats), 4)}
        run["examples_per_s"] = round(run["examples"] / run["seconds"], 1) if run["seconds"] > 0 else None
        manifest["runs"] = [*manifest.get("runs", []), run]
        store.refresh_manifest(out, manifest)
    runner.barrier(world)
    return load_scan(out)
