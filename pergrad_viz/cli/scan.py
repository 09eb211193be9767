"""``python -m pergrad_viz scan ...`` and ``scan-bench ...``: whole-dataset scans from the command line.

One process (without ``--checkpoint``, a seeded untrained model; ``--checkpoint FILE`` loads a state_dict saved
with ``torch.save(model.state_dict(), FILE)`` of
``pergrad_viz.tutorial.networks.SmallCNN`` or ``MLP(784, hidden, 10)``)::

    python -m pergrad_viz scan --data fashion-mnist --model cnn \\
        --quantities loss,grad_norm,el2n --proj-dim 256 --out scans/train

Several processes (one machine; gloo on CPU, NCCL with --device cuda): the same arguments under torchrun::

    torchrun --nproc_per_node 2 -m pergrad_viz scan --data fashion-mnist --model cnn --out scans/train

Several machines: start the same command on every node with torchrun's rendezvous, with ``--out`` on a file system
every node shares.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from pergrad_viz.cli.args import HelpFormatter, device, non_negative_int, positive_int, positive_ints
from pergrad_viz.scanning.api import QUANTITIES
from pergrad_viz.tutorial.networks import load_model

MODELS = ("mlp", "cnn")
DATA = ("fashion-mnist", "fashion-mnist-sample")
DEFAULT_QUANTITIES = "loss,grad_norm,layer_norms,el2n"

SCAN_DESCRIPTION = """\
Scan a dataset: per-example losses, gradient norms (in total and per layer), EL2N scores
and gradient sketches (projections), written to DIR in dataset order: a manifest.json and
one .npy file per quantity, read back with pergrad_viz.load_scan(DIR). A rerun into the
same DIR continues where a killed run stopped; one with another model, dataset or
settings is refused, naming the differences."""

SCAN_EPILOG = """\
examples:
  python -m pergrad_viz scan --data fashion-mnist-sample --model cnn --limit 500 \\
      --proj-dim 256 --out scans/sample
  torchrun --nproc_per_node 2 -m pergrad_viz scan --model cnn --out scans/train

Under torchrun, each process takes every W-th pending chunk and writes its rows into the
shared files (gloo on CPU, NCCL with --device cuda); the result is identical to one
process's. On several machines, run the same command on each node with torchrun's
rendezvous (--nnodes 2 --nproc_per_node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29400
--rdzv-id scan1) and --out on a file system every node shares."""

SCAN_BENCH_DESCRIPTION = """\
A scan's throughput (examples/s) next to a plain forward+backward over the same examples,
in one process and under torchrun with N processes; medians over interleaved rounds."""


def _quantities(text: str) -> list[str]:
    names = [q.strip() for q in text.split(",") if q.strip()]
    bad = [q for q in names if q not in QUANTITIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown quantities {', '.join(bad) or '(none)'}; valid: {', '.join(QUANTITIES)}")
    return names


def _common(p: argparse.ArgumentParser, limit: int | None, threads: int | None) -> None:
    p.add_argument("--data", choices=DATA, default="fashion-mnist",
                   help="fashion-mnist: the full 60,000 + 10,000 images from $PERGRAD_VIZ_DATA/fashion-mnist, the "
                        "checkout's data/ (make data puts them there) or Debian's dataset-fashion-mnist, "
                        "decompressed once into $PERGRAD_VIZ_CACHE (default ~/.cache/pergrad_viz, about 55 MB), "
                        "else the bundled sample with a note; fashion-mnist-sample: "
                        "always the bundled 1,000 + 1,000 images (default: fashion-mnist)")
    p.add_argument("--split", choices=("train", "test"), default="train", help="which split (default: train)")
    p.add_argument("--limit", type=positive_int, default=limit, metavar="N",
                   help="the first N examples only (default: " + ("all" if limit is None else f"{limit}") + ")")
    p.add_argument("--model", choices=MODELS, default="cnn",
                   help="mlp: MLP(784, --hidden, 10); cnn: pergrad_viz.tutorial.networks.SmallCNN (default: cnn)")
    p.add_argument("--hidden", type=positive_int, default=20, metavar="H",
                   help="hidden width of --model mlp (default: 20)")
    p.add_argument("--batch-size", type=positive_int, default=256, metavar="B",
                   help="examples per batch (default: 256)")
    p.add_argument("--threads", type=positive_int, default=threads, metavar="N",
                   help="torch.set_num_threads(N) in each process (default: "
                        + ("torch's own setting" if threads is None else f"{threads}") + ")")


def add_subcommands(sub: argparse._SubParsersAction) -> None:
    """Register ``scan`` and ``scan-bench`` on the ``python -m pergrad_viz`` parser."""
    s = sub.add_parser("scan", help="per-example losses, gradient norms, EL2N, gradient sketches of a dataset to DIR",
                       description=SCAN_DESCRIPTION, epilog=SCAN_EPILOG, formatter_class=HelpFormatter)
    _common(s, limit=None, threads=None)
    s.add_argument("--checkpoint", metavar="FILE",
                   help="a state_dict of the --model saved with torch.save(model.state_dict(), FILE) (default: a "
                        "seeded, untrained model)")
    s.add_argument("--model-seed", type=non_negative_int, default=0, metavar="SEED",
                   help="torch.manual_seed for the model without --checkpoint (default: 0)")
    s.add_argument("--quantities", type=_quantities, default=_quantities(DEFAULT_QUANTITIES), metavar="Q1,Q2,...",
                   help=f"comma-separated from {', '.join(QUANTITIES)} (default: {DEFAULT_QUANTITIES})")
    s.add_argument("--proj-dim", type=positive_int, default=None, metavar="K",
                   help="also a sketch of each example's gradient, K numbers (adds 'projection'; default: none)")
    s.add_argument("--seed", type=non_negative_int, default=0, help="seed of the projection (default: 0)")
    s.add_argument("--chunk-size", type=positive_int, default=None, metavar="N",
                   help="examples per resumable chunk, a multiple of --batch-size (default: as many batches as make "
                        "about 16 chunks, at most 64 batches)")
    s.add_argument("--out", required=True, metavar="DIR", help="the scan's directory, created or continued "
                                                               "(required)")
    s.add_argument("--device", type=device, default=None,
                   help="cpu or cuda; under torchrun each process takes cuda:LOCAL_RANK (default: cuda if available, "
                        "else cpu)")
    s.add_argument("--num-workers", type=non_negative_int, default=0, metavar="N",
                   help="DataLoader worker processes per process (default: 0, load in the process)")
    s.add_argument("--no-progress", action="store_true", help="no progress bar (default: a bar on stderr)")
    s.set_defaults(run=run_scan)

    b = sub.add_parser("scan-bench", help="scan throughput (examples/s) next to a plain forward+backward, 1 vs N "
                                          "processes", description=SCAN_BENCH_DESCRIPTION,
                       formatter_class=HelpFormatter)
    _common(b, limit=4096, threads=1)
    b.add_argument("--proj-dim", type=positive_int, default=256, metavar="K",
                   help="width of the gradient sketch in the projection row (default: 256)")
    b.add_argument("--processes", type=positive_ints, default=[1, 2], metavar="W1,W2,...",
                   help="numbers of processes to scan with, under torchrun (1 = in this process; default: 1,2)")
    b.add_argument("--rounds", type=positive_int, default=3,
                   help="interleaved rounds; the table shows medians (default: 3)")
    b.add_argument("--full-data", action="store_true",
                   help="also time one whole-dataset scan (all quantities, proj 256) with the largest --processes "
                        "(default: off)")
    b.set_defaults(run=run_scan_bench)


def _distributed(device: str) -> tuple[int, int, str]:
    """Join the torchrun group when there is one (gloo on CPU, NCCL on CUDA); returns (rank, world, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, device
    dist = torch.distributed
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = f"cuda:{local}"
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device(device))
    else:
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size(), device


def run_scan(args: argparse.Namespace) -> int:
    from pergrad_viz.scanning.api import scan
    from pergrad_viz.tutorial import fashion_mnist

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    rank, world, device = _distributed(device)
    try:
        model = load_model(args.model, args.checkpoint, args.hidden, args.model_seed).to(device)
        if rank == 0 and not args.checkpoint:
            print(f"note: no --checkpoint: scanning an untrained {args.model} (torch.manual_seed({args.model_seed}))",
                  file=sys.stderr)
        source = fashion_mnist.FIND if args.data == "fashion-mnist" else None
        dataset = fashion_mnist.fashion_mnist(args.split, limit=args.limit, source=source, quiet=rank != 0)
        try:
            result = scan(model, torch.nn.CrossEntropyLoss(), dataset, quantities=args.quantities,
                          batch_size=args.batch_size, proj_dim=args.proj_dim, out=args.out, seed=args.seed,
                          chunk_size=args.chunk_size, num_workers=args.num_workers, progress=not args.no_progress)
        except (ValueError, TypeError, OSError) as exc:  # refusals (their messages name the fix)
            where = f" (rank {rank})" if world > 1 else ""  # each process's own: another's may be the cause
            message = str(exc).replace("pass proj_dim=K", "pass --proj-dim K").replace("new out= directory",
                                                                                       "new --out directory")
            print(f"error{where}: {message}", file=sys.stderr)
            return 2
        if rank == 0:
            run = result.manifest["runs"][-1]
            if not run["examples"]:  # every chunk was there already
                print(f"{args.out} is complete: all {len(dataset)} examples were scanned before (nothing to do)")
                return 0
            shapes = ", ".join(f"{q} {tuple(t.shape)}" for q, t in result.items())
            print(f"scanned {run['examples']} of {len(dataset)} examples ({args.data} {args.split}) with {world} "
                  f"process(es) on {device} in {run['seconds']:.2f} s ({run['examples_per_s'] or 0:,.0f} examples/s); "
                  f"{args.out}: {shapes}")
    finally:
        if world > 1:
            torch.distributed.destroy_process_group()
    return 0


def run_scan_bench(args: argparse.Namespace) -> int:
    from pergrad_viz.bench import scans as scan_bench

    records = scan_bench.throughput(model=args.model, hidden=args.hidden, n=args.limit, split=args.split,
                                    data=args.data, batch_size=args.batch_size, proj_dim=args.proj_dim,
                                    processes=args.processes, rounds=args.rounds, threads=args.threads)
    print(scan_bench.header(args))
    print(scan_bench.format_table(records))
    if args.full_data:
        full = scan_bench.full_data_timing(model=args.model, hidden=args.hidden, data=args.data, split=args.split,
                                           batch_size=args.batch_size, proj_dim=args.proj_dim,
                                           processes=max(args.processes), threads=args.threads)
        print(full)
    return 0
