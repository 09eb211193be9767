"""``python -m pergrad_viz bench ...``: side-by-side timings in the terminal, optionally as CSV and PNG.

Example::

    python -m pergrad_viz bench --quantity grads --batch-sizes 2,32,128 --hidden 20 --peers all
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

import torch

from . import bench, bench_models, peers
from .cli_args import positive_ints
from .strategies import STRATEGIES


def _names(valid: Sequence[str], what: str):
    def parse(text: str) -> list[str]:
        names = list(valid) if text == "all" else [v.strip() for v in text.split(",") if v.strip()]
        bad = [n for n in names if n not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}; valid: all, {', '.join(valid)}")
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pergrad_viz", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="time strategies (and peers) on MLP(784, hidden, 10) with sample images")
    b.add_argument("--model", choices=bench_models.MODELS, default=None,
                   help="a real architecture (per-sample gradients, B=32 by default) instead of the MLP sweep")
    b.add_argument("--targets", action="store_true",
                   help="measure the project's performance targets (several tables, then one line per target)")
    b.add_argument("--quantity", choices=bench.QUANTITIES, default="grads")
    b.add_argument("--batch-sizes", type=positive_ints, default=[2, 32, 128], metavar="B1,B2,...")
    b.add_argument("--hidden", type=positive_ints, default=[20], metavar="H1,H2,...", help="hidden widths")
    b.add_argument("--strategies", type=_names((*STRATEGIES, "auto"), "strategy"), default=list(STRATEGIES),
                   metavar="NAMES", help="comma-separated, or 'all' (default: the five strategies)")
    b.add_argument("--peers", type=_names(peers.PEERS, "peer"), default=[], metavar="NAMES",
                   help="opacus,backpack or 'all' (per-sample gradients only)")
    b.add_argument("--flat", action="store_true", help="ask for one flat (B, P) result")
    b.add_argument("--out-buffer", action="store_true", help="write into a preallocated flat buffer (out=)")
    b.add_argument("--chunk-sizes", type=positive_ints, default=[], metavar="C1,C2,...",
                   help="also time each fast strategy with these chunk_size values")
    b.add_argument("--norms", action="store_true",
                   help="also time per_sample_grad_norms against materialising + .norm (gradients only)")
    b.add_argument("--slow-limit", type=int, default=20480,
                   help="skip loop/autograd_stack/batched_grad above this many sample-backward passes per call")
    b.add_argument("--min-run-time", type=float, default=0.5, help="seconds of timing per method and setting")
    b.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: unchanged)")
    b.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    b.add_argument("--device", default="cpu", help="cpu or cuda")
    b.add_argument("--csv", metavar="FILE", help="also write the records as CSV")
    b.add_argument("--plot", metavar="FILE.png", help="also save a log-log runtime plot")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    from . import cli_scan  # scan, scan-bench

    cli_scan.add_subcommands(sub)
    return parser


def run_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peers and args.quantity != "grads":
        print("error: --peers compute per-sample gradients only; use --quantity grads", file=sys.stderr)
        return 2
    missing = [p for p in args.peers if not peers.available(p)]
    if missing:
        print(f"error: peer(s) not installed: {', '.join(missing)} (pip install opacus backpack-for-pytorch)",
              file=sys.stderr)
        return 2
    if args.targets:
        from . import bench_targets

        print(bench_targets.report(min_run_time=args.min_run_time))
        return 0
    if args.model is not None:
        return _run_model_bench(args)
    records = bench.sweep(args.quantity, args.batch_sizes, args.hidden, strategies=args.strategies,
                          peers=args.peers, slow_limit=args.slow_limit, min_run_time=args.min_run_time,
                          flat=args.flat, out_buffer=args.out_buffer, chunk_sizes=args.chunk_sizes,
                          norms=args.norms, device=args.device,
                          dtype=getattr(torch, args.dtype), progress=not args.no_progress)
    print(f"# {args.quantity} on MLP(784, hidden, 10), {args.dtype}, {args.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.machine()} "
          f"{platform.processor() or ''}".rstrip())
    print("# vs loop = speed-up over the loop; vs fwd+bwd and vs floor = time / reference time (same run)")
    print(bench.format_table(records))
    if args.csv:
        bench.write_csv(records, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        from . import plots

        fig = plots.runtime_figure(records, title=f"{args.quantity}: time vs batch size")
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    return 0


def _run_model_bench(args: argparse.Namespace) -> int:
    if args.quantity != "grads":
        print("error: --model benchmarks per-sample gradients: use --quantity grads", file=sys.stderr)
        return 2
    strategies = [*args.strategies, "auto"] if "auto" not in args.strategies else args.strategies
    batches = args.batch_sizes if args.batch_sizes_given else [32]
    records = bench.model_sweep(args.model, batches, strategies=strategies, peers=args.peers,
                                slow_limit=args.slow_limit, min_run_time=args.min_run_time, flat=True,
                                out_buffer=args.out_buffer, norms=args.norms, device=args.device,
                                dtype=getattr(torch, args.dtype), progress=not args.no_progress)
    print(f"# per-sample gradients (B, P) of {args.model}, flat, {args.dtype}, {args.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.machine()}")
    print("# vs loop = speed-up over the loop; vs fwd+bwd and vs floor = time / reference time (same run)")
    print(bench.format_table(records))
    if args.csv:
        bench.write_csv(records, args.csv)
        print(f"wrote {args.csv}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.batch_sizes_given = any(a.startswith("--batch-sizes") for a in argv)
    if getattr(args, "run", None) is not None:  # scan, scan-bench (pergrad_viz.cli_scan)
        return args.run(args)
    return run_bench(args) if args.command == "bench" else 2


if __name__ == "__main__":
    sys.exit(main())
