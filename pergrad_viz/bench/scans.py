"""Scan throughput (examples/s): losses only, grad norms, projections, next to a plain forward+backward over
the same data, on 1 process and under ``torchrun`` with several.

``python -m pergrad_viz scan-bench --model cnn --limit 4096 --processes 1,2`` prints a table. Each method runs
once per round and the rounds interleave the methods (so drifts of a shared machine hit them alike); the
table shows medians over rounds. "loop s" is the time of the scan's own loop (data loading, compute, writing
the rows, flushing), as the scan records it in its manifest (for several processes: the slowest one); "wall s"
adds everything around it (fingerprints, creating the files; for torchrun, starting the processes).
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from pergrad_viz.scanning.api import scan
from pergrad_viz.scanning.runner import data_loader
from pergrad_viz.tutorial import fashion_mnist
from pergrad_viz.tutorial.networks import load_model

GRAD_NORMS = "loss,grad_norm,layer_norms,el2n"
METHODS: dict[str, tuple[str, bool]] = {  # label -> (quantities, with projection)
    "scan: losses only": ("loss", False),
    "scan: grad norms": (GRAD_NORMS, False),
    "scan: + projection": (GRAD_NORMS, True),
}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_command(nproc: int, scan_args: list[str], port: int | None = None) -> list[str]:
    """``python -m torch.distributed.run --nproc_per_node N ... -m pergrad_viz scan ARGS`` on 127.0.0.1."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--nnodes=1",
            "--master_addr=127.0.0.1", f"--master_port={port or free_port()}", "-m", "pergrad_viz", "scan",
            *scan_args]


def _dataset(data: str, split: str, n: int | None) -> torch.utils.data.TensorDataset:
    source = fashion_mnist.FIND if data == "fashion-mnist" else None
    return fashion_mnist.fashion_mnist(split, limit=n, source=source, quiet=True)


def _plain(model: nn.Module, dataset: torch.utils.data.Dataset, batch_size: int) -> float:
    """Seconds for one ordinary forward+backward per batch over the dataset (same DataLoader as a scan)."""
    n = len(dataset)
    batches = [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]
    loss_fn = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for x, y in data_loader(dataset, batches):
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return seconds


def _scan_args(model: str, hidden: int, data: str, split: str, n: int | None, batch_size: int, quantities: str,
               proj_dim: int | None, out: Path, threads: int | None) -> list[str]:
    args = ["--model", model, "--hidden", str(hidden), "--data", data, "--split", split, "--batch-size",
            str(batch_size), "--quantities", quantities, "--out", str(out), "--device", "cpu", "--no-progress"]
    if n is not None:
        args += ["--limit", str(n)]
    if proj_dim is not None:
        args += ["--proj-dim", str(proj_dim)]
    if threads:
        args += ["--threads", str(threads)]
    return args


def _torchrun(nproc: int, args: list[str], out: Path) -> tuple[float, float, int]:
    """(loop seconds, wall seconds, examples) of a scan under torchrun."""
    start = time.perf_counter()
    proc = subprocess.run(torchrun_command(nproc, args), capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"torchrun scan failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    run = json.loads((out / "manifest.json").read_text())["runs"][-1]
    return run["seconds"], wall, run["examples"]


def throughput(model: str = "cnn", *, hidden: int = 20, n: int = 4096, split: str = "train",
               data: str = "fashion-mnist", batch_size: int = 256, proj_dim: int = 256,
               processes: list[int] | tuple[int, ...] = (1, 2), rounds: int = 3, threads: int | None = 1) -> list[dict]:
    """Time the scan methods and a plain forward+backward on the first ``n`` examples; one record per
    (method, processes) with the median loop and wall seconds over ``rounds`` and examples/s; torch's thread count
    at ``threads`` meanwhile (as it was after)."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _throughput(model, hidden, n, split, data, batch_size, proj_dim, processes, rounds, threads)
    finally:
        torch.set_num_threads(previous)


def _throughput(model: str, hidden: int, n: int, split: str, data: str, batch_size: int, proj_dim: int,
                processes: list[int] | tuple[int, ...], rounds: int, threads: int | None) -> list[dict]:
    net = load_model(model, None, hidden, seed=0)
    dataset = _dataset(data, split, n)
    n = len(dataset)
    times: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="scan-bench-") as tmp:
        # each method's first call (its plan, the imports it makes) on one batch, outside the rounds: with --rounds 1
        # it was the timing (a probe: 205 ms against 8 ms at 3 rounds)
        warm = torch.utils.data.Subset(dataset, range(min(n, batch_size)))
        _plain(net, warm, batch_size)
        for k, (quantities, projected) in enumerate(METHODS.values()):
            scan(net, nn.CrossEntropyLoss(), warm, quantities=quantities, proj_dim=proj_dim if projected else None,
                 batch_size=batch_size, out=Path(tmp) / f"warm-{k}", progress=False)
        for r in range(rounds):
            start = time.perf_counter()
            plain = _plain(net, dataset, batch_size)
            times.setdefault(("forward+backward", 1), []).append((plain, time.perf_counter() - start))
            for label, (quantities, projected) in METHODS.items():
                k = proj_dim if projected else None
                for w in processes:
                    out = Path(tmp) / f"{r}-{list(METHODS).index(label)}-{w}"
                    if w == 1:
                        start = time.perf_counter()
                        result = scan(net, nn.CrossEntropyLoss(), dataset, quantities=quantities, proj_dim=k,
                                      batch_size=batch_size, out=out, progress=False)
                        wall = time.perf_counter() - start
                        loop = result.manifest["runs"][-1]["seconds"]
                        del result
                    else:
                        loop, wall, _ = _torchrun(w, _scan_args(model, hidden, data, split, n, batch_size,
                                                                quantities, k, out, threads), out)
                    times.setdefault((label, w), []).append((loop, wall))
    base = statistics.median(t for t, _ in times[("forward+backward", 1)])
    records = []
    for (label, w), ts in times.items():
        loop = statistics.median(t for t, _ in ts)
        wall = statistics.median(t for _, t in ts)
        records.append({"method": label, "processes": w, "model": model, "examples": n, "batch": batch_size,
                        "loop_s": loop, "wall_s": wall, "examples_per_s": n / loop, "vs_plain": base / loop,
                        "proj_dim": proj_dim if METHODS.get(label, ("", False))[1] else None})
    return records


def full_data_timing(model: str = "cnn", *, hidden: int = 20, data: str = "fashion-mnist", split: str = "train",
                     batch_size: int = 256, proj_dim: int = 256, processes: int = 2, threads: int | None = 1) -> str:
    """One scan of the whole split (every quantity, projection ``proj_dim``) under torchrun; a line of text."""
    with tempfile.TemporaryDirectory(prefix="scan-full-") as tmp:
        out = Path(tmp) / "full"
        args = _scan_args(model, hidden, data, split, None, batch_size, GRAD_NORMS, proj_dim, out, threads)
        if processes == 1:
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "pergrad_viz", "scan", *args], capture_output=True,
                                  text=True, timeout=7200)
            wall = time.perf_counter() - start
            if proc.returncode:
                raise RuntimeError(f"scan failed:\n{proc.stderr[-4000:]}")
            run = json.loads((out / "manifest.json").read_text())["runs"][-1]
            loop, examples = run["seconds"], run["examples"]
        else:
            loop, wall, examples = _torchrun(processes, args, out)
    return (f"full {split} split: {examples:,} examples, {model}, quantities {GRAD_NORMS},projection "
            f"(proj_dim {proj_dim}), {processes} process(es): loop {loop:.1f} s ({examples / loop:,.0f} examples/s), "
            f"wall {wall:.1f} s including start-up")


def header(args: argparse.Namespace | None = None) -> str:
    threads = getattr(args, "threads", None) or torch.get_num_threads()
    return (f"# scan throughput, {platform.machine()}, torch {torch.__version__}, {threads} thread(s) per process, "
            "float32, cpu\n# examples/s = examples / loop s; vs fwd+bwd = throughput relative to the plain "
            "forward+backward (same run)")


def _fmt(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def format_table(records: list[dict]) -> str:
    """A plain-text table of :func:`throughput` records."""
    head = ("method", "procs", "model", "examples", "batch", "loop", "wall", "examples/s", "vs fwd+bwd")
    rows = [(r["method"] + (f" {r['proj_dim']}" if r["proj_dim"] else ""), str(r["processes"]), r["model"],
             f"{r['examples']:,}", str(r["batch"]), _fmt(r["loop_s"]), _fmt(r["wall_s"]),
             f"{r['examples_per_s']:,.0f}", f"{r['vs_plain']:.2f}x") for r in records]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    left = {0, 2}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                             strict=True))).rstrip()

    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, rows)])
