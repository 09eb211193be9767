"""``python -m pergrad_viz bench|scan|scan-bench ...``: benchmarks and whole-dataset scans from the command line.

Example::

    python -m pergrad_viz bench --quantity grads --batch-sizes 2,32,128 --hidden 20 --peers all

The help texts are plain text (no reST): ``python -m pergrad_viz bench --help`` is meant to read like the README.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from collections.abc import Sequence

import torch

from pergrad_viz import __version__, bench
from pergrad_viz.bench import peers
from pergrad_viz.bench import problems as bench_models
from pergrad_viz.cli.args import HelpFormatter, device, positive_int, positive_ints, positive_number
from pergrad_viz.core import extras
from pergrad_viz.core.process import NO_BATCHING_RULE
from pergrad_viz.errors import MissingExtraError
from pergrad_viz.strategies import STRATEGIES

DESCRIPTION = """\
pergrad-viz from the command line. Per-sample gradients (B, P) and per-sample output
Jacobians (B, Y, P) in PyTorch: benchmarks and whole-dataset scans. Run a command with
--help for its options."""

EXAMPLES = """\
examples:
  python -m pergrad_viz bench --quantity grads --batch-sizes 2,32,128 --hidden 20
  python -m pergrad_viz bench --quantity jacobian --batch-sizes 2,32 --csv j.csv --plot j.png
  python -m pergrad_viz bench --model resnet18 --strategies all --norms
  python -m pergrad_viz scan --data fashion-mnist-sample --model cnn --limit 500 --out scans/sample"""

BENCH_DESCRIPTION = """\
Time the strategies of pergrad_viz side by side, each result checked against the others,
on the tutorial's MLP(784, hidden, 10) with the bundled Fashion-MNIST images (MSE loss,
reduction='sum') at every batch size and hidden width asked for; or, with --model, the
per-sample gradients of a real architecture. Every method and two reference rows are
timed in interleaved rounds (each round times every method once, in a rotating order), so
a stall of the machine hits them all alike. Prints one table; --csv and --plot save it."""

BENCH_COLUMNS = """\
the table, one row per method and setting:
  quantity     grads (per-sample gradients, B x P) or jacobian (B x Y x P)
  batch        the batch size B
  hidden       the hidden width of the MLP ("-" with --model)
  method       a strategy (loop, autograd_stack, torch_func, batched_grad, hooks, auto),
               a peer (opacus, backpack), an extra row (hand vmap, grad norms,
               grads + norm, "auto chunk=C"), or one of two references:
               forward+backward: one ordinary batched loss backward of the same batch;
               memory floor: filling a tensor of the result's size once, the least any
               method can do
  median       the median time of one call over the interleaved rounds
  IQR          the interquartile range of those times (the spread); above 25% of the
               median the note says NOISY ... rerun
  vs loop      the loop's median / this median: the speed-up over the loop (2x: twice
               as fast as the loop)
  vs fwd+bwd   this median / the forward+backward median (1x: as cheap as one ordinary
               backward pass)
  vs floor     this median / the memory floor's median
  result       the result's size in memory (B x P, or B x Y x P, numbers of --dtype;
               B numbers for the norm rows)
  max |diff|   the largest element-wise |difference| between this result and the loop's,
               which is the definition of the per-sample gradient (when the loop does not
               run: the first method that ran; the two norm rows: each other). A peer that
               disagrees with pergrad_viz is not timed
  note         why a row was skipped (--slow-limit) or failed, which strategy auto chose,
               NOISY, the model
A dash means not measured: the note says why."""


def _names(valid: Sequence[str], what: str):
    def parse(text: str) -> list[str]:
        names = list(valid) if text == "all" else [v.strip() for v in text.split(",") if v.strip()]
        bad = [n for n in names if n not in valid]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)}; valid: all, {', '.join(valid)}")
        return names

    return parse


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m pergrad_viz`` parser: ``bench`` here, ``scan`` and ``scan-bench`` from cli_scan."""
    parser = argparse.ArgumentParser(prog="python -m pergrad_viz", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"pergrad-viz {__version__}")
    sub = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    b = sub.add_parser("bench", help="time the strategies (and peers) side by side, print a table",
                       description=BENCH_DESCRIPTION, epilog=BENCH_COLUMNS, formatter_class=HelpFormatter)
    strategies = ", ".join(STRATEGIES)
    b.add_argument("--model", choices=bench_models.MODELS, default=None,
                   help="per-sample gradients of this architecture (B=32 unless --batch-sizes; B=16 for the "
                        "Hugging Face, timm and peft models gpt2 ... lora-llama, which need transformers, timm and "
                        "peft), with a hand-written vmap row, instead of the MLP sweep (default: the MLP sweep)")
    b.add_argument("--targets", action="store_true",
                   help="measure the project's performance goals instead: several tables, then one line per goal "
                        "(a few minutes; default: off)")
    b.add_argument("--dp", action="store_true",
                   help="the DP-SGD gradient of one batch instead: plain forward+backward, pv.clipped_grad_sum, "
                        "per_sample_grads + clipping, Opacus' ghost clipping; one table per model (mlp = MLP(784, "
                        "512, 10), transformer, resnet18, gpt2, bert, lora-llama, or --model), B=32 unless "
                        "--batch-sizes; time, peak memory, max |diff| from the loop (default: off)")
    b.add_argument("--quantity", choices=bench.QUANTITIES, default="grads",
                   help="grads: per-sample gradients (B, P) of the loss; jacobian: per-sample output Jacobians "
                        "(B, Y, P) (default: grads)")
    b.add_argument("--batch-sizes", type=positive_ints, default=None, metavar="B1,B2,...",
                   help="batch sizes, comma-separated (default: 2,32,128; 32 with --model)")
    b.add_argument("--hidden", type=positive_ints, default=[20], metavar="H1,H2,...",
                   help="hidden widths of MLP(784, hidden, 10), comma-separated (default: 20)")
    b.add_argument("--strategies", type=_names((*STRATEGIES, "auto"), "strategy"), default=list(STRATEGIES),
                   metavar="NAMES", help=f"comma-separated from {strategies}, auto; or all (default: the five "
                                         "strategies; --model always adds auto)")
    b.add_argument("--peers", type=_names(peers.PEERS, "peer"), default=[], metavar="NAMES",
                   help="also time other libraries: opacus, backpack, comma-separated, or all; per-sample "
                        "gradients only, each checked against pergrad_viz first (default: none)")
    b.add_argument("--flat", action="store_true",
                   help="ask for one flat (B, P) tensor instead of a dict of per-parameter tensors (default: off; "
                        "always on with --model)")
    b.add_argument("--out-buffer", action="store_true",
                   help="write into a preallocated flat buffer (out=), implies --flat (default: off)")
    b.add_argument("--chunk-sizes", type=positive_ints, default=[], metavar="C1,C2,...",
                   help="also time each fast strategy with these chunk_size values (default: none)")
    b.add_argument("--norms", action="store_true",
                   help="also time per_sample_grad_norms against materialising (B, P) and taking .norm "
                        "(gradients only; default: off)")
    b.add_argument("--slow-limit", type=positive_int, default=20480, metavar="N",
                   help="skip loop, autograd_stack and batched_grad where one call would push more than N samples "
                        "through backward passes (default: 20480)")
    b.add_argument("--min-run-time", type=positive_number, default=0.5, metavar="SECONDS",
                   help="seconds of timing per method and setting (default: 0.5)")
    b.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch.set_num_threads(N) first (default: torch's own setting)")
    b.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                   help="dtype of the model and inputs (default: float32)")
    b.add_argument("--device", type=device, default="cpu",
                   help="cpu or cuda; on cuda every clock reading is preceded by torch.cuda.synchronize() (default: "
                        "cpu)")
    b.add_argument("--csv", metavar="FILE", help="also write the records as CSV (default: no file)")
    b.add_argument("--plot", metavar="FILE.png",
                   help="also save a log-log plot of time against batch size, MLP sweep only (default: no plot)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar (default: a bar on stderr)")
    from pergrad_viz.cli import scan as cli_scan  # scan, scan-bench

    cli_scan.add_subcommands(sub)
    return parser


def _legend(records: Sequence[bench.Record]) -> str:
    """The comment lines printed above a table: what its ratio columns and max |diff| are measured against."""
    reference = next((r.strategy for r in records if r.max_abs_diff is not None), None)
    lines = ["# vs loop = speed-up over the loop; vs fwd+bwd and vs floor = time / reference time (same rounds)"]
    if reference is not None:
        against = "the loop's result (the definition)" if reference == "loop" else f"the {reference} result"
        lines.append(f"# max |diff| = largest element-wise |difference| from {against}; bench --help: every column")
    return "\n".join(lines)


def _sample_missing() -> str | None:
    """The error message when the bundled sample the MLP benchmarks read cannot be loaded, else None."""
    from pergrad_viz.tutorial.data import load_sample

    try:
        load_sample(1)
    except (FileNotFoundError, ValueError) as exc:
        return str(exc)
    return None


def _output_problem(path: str, what: str) -> str | None:
    """Why ``path`` cannot be written as ``what``'s file (a folder, a missing folder, a format matplotlib cannot
    write), or None: said before the timing, not after it."""
    if os.path.isdir(path):
        return f"{what} {path} is a folder: give a file name"
    folder = os.path.dirname(path) or "."
    if not os.path.isdir(folder):
        return f"{what} {path}: the folder {folder} does not exist"
    if what == "--plot":
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if os.path.splitext(path)[1].lower().lstrip(".") not in formats:
            return f"--plot {path}: matplotlib writes {', '.join(sorted(formats))}; name the file e.g. plot.png"
    return None


def _unused_options(args: argparse.Namespace) -> list[str]:
    """The options given that this kind of run does not read, each named with the runs that do."""
    mode = "--dp" if args.dp else "--targets" if args.targets else "--model" if args.model else "the MLP sweep"
    given = {"--plot": args.plot, "--csv": args.csv, "--norms": args.norms, "--chunk-sizes": args.chunk_sizes,
             "--hidden": args.hidden != [20], "--peers": args.peers,
             "--strategies": list(args.strategies) != list(STRATEGIES), "--batch-sizes": args.batch_sizes,
             "--model": args.model and args.targets, "--targets": args.targets and args.dp}
    used_by = {"--plot": ("the MLP sweep",), "--csv": ("the MLP sweep", "--model"),
               "--norms": ("the MLP sweep", "--model") if args.quantity == "grads" else (),
               "--chunk-sizes": ("the MLP sweep",), "--hidden": ("the MLP sweep",),
               "--peers": ("the MLP sweep", "--model"), "--strategies": ("the MLP sweep", "--model"),
               "--batch-sizes": ("the MLP sweep", "--model", "--dp"), "--model": (), "--targets": ()}
    return [f"note: {option} is not used by {mode}" + (f" (only by {' and '.join(used_by[option])})"
                                                       if used_by[option] else "") + ": ignored"
            for option, value in given.items() if value and mode not in used_by[option]]


def run_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    for note in _unused_options(args):
        print(note, file=sys.stderr)
    if args.peers and args.quantity != "grads":
        print("error: --peers compute per-sample gradients only; use --quantity grads", file=sys.stderr)
        return 2
    missing = [p for p in args.peers if not peers.available(p)]
    if missing:
        print(f"error: peer(s) not installed: {', '.join(missing)} (pip install 'pergrad-viz[peers]')",
              file=sys.stderr)
        return 2
    if args.plot and not extras.available("matplotlib"):  # before the timing, not after it
        raise extras.missing_extra("matplotlib", "--plot", extra="viz")
    for option, path in (("--csv", args.csv), ("--plot", args.plot)):
        problem = path and _output_problem(path, option)
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.model is None or args.dp:  # the MLP sweep, --dp, the targets read the bundled images: fail before a bar
        problem = _sample_missing()
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    if args.dp:
        if args.quantity != "grads":
            print("error: --dp measures the DP-SGD gradient (per-sample gradients): use --quantity grads",
                  file=sys.stderr)
            return 2
        from pergrad_viz.bench import dp as bench_dp

        models = (args.model,) if args.model is not None else bench_dp.DP_MODELS
        for batch in args.batch_sizes or [32]:
            bench_dp.report(models, batch=batch, device=args.device, emit=lambda text: print(text, flush=True))
        return 0
    if args.targets:
        from pergrad_viz.bench import targets as bench_targets

        print(bench_targets.report(min_run_time=args.min_run_time, emit=lambda text: print(text, flush=True)))
        return 0
    if args.model is not None:
        return _run_model_bench(args)
    records = bench.sweep(args.quantity, args.batch_sizes or [2, 32, 128], args.hidden, strategies=args.strategies,
                          peers=args.peers, slow_limit=args.slow_limit, min_run_time=args.min_run_time,
                          flat=args.flat, out_buffer=args.out_buffer, chunk_sizes=args.chunk_sizes,
                          norms=args.norms, device=args.device,
                          dtype=getattr(torch, args.dtype), progress=not args.no_progress)
    print(f"# {args.quantity} on MLP(784, hidden, 10), {args.dtype}, {args.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.machine()} "
          f"{platform.processor() or ''}".rstrip())
    print(_legend(records))
    print(bench.format_table(records))
    if args.csv:
        bench.write_csv(records, args.csv)
        print(f"wrote {args.csv}")
    if args.plot:
        from pergrad_viz import viz

        fig = viz.runtime_figure(records, title=f"{args.quantity}: time vs batch size")
        fig.savefig(args.plot, dpi=120, bbox_inches="tight")
        print(f"wrote {args.plot}")
    return 0


def _run_model_bench(args: argparse.Namespace) -> int:
    if args.quantity != "grads":
        print("error: --model benchmarks per-sample gradients: use --quantity grads", file=sys.stderr)
        return 2
    strategies = [*args.strategies, "auto"] if "auto" not in args.strategies else args.strategies
    batches = args.batch_sizes or [bench_models.BATCH.get(args.model, 32)]
    records = bench.model_sweep(args.model, batches, strategies=strategies, peers=args.peers,
                                slow_limit=args.slow_limit, min_run_time=args.min_run_time, flat=True,
                                out_buffer=args.out_buffer, norms=args.norms, device=args.device,
                                dtype=getattr(torch, args.dtype), progress=not args.no_progress)
    print(f"# per-sample gradients (B, P) of {args.model}, flat, {args.dtype}, {args.device}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.machine()}")
    print(_legend(records))
    print(bench.format_table(records))
    if args.csv:
        bench.write_csv(records, args.csv)
        print(f"wrote {args.csv}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default: ``sys.argv[1:]``) and run the subcommand; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if getattr(args, "run", None) is not None:  # scan, scan-bench (pergrad_viz.cli.scan)
            return args.run(args)
        if args.command != "bench":
            return 2
        with warnings.catch_warnings():
            # vmap's note that an operation runs without a batching rule (slower, as timed; "please file us an
            # issue"), printed into the progress bar by the hand-written vmap and batched_grad: the table says the cost
            warnings.filterwarnings("ignore", message=NO_BATCHING_RULE)
            return run_bench(args)
    except KeyboardInterrupt:
        kept = " (the chunks a scan finished are kept: rerun the same command to continue)" \
            if args.command == "scan" else ""
        print(f"interrupted{kept}", file=sys.stderr)
        return 130
    except MissingExtraError as e:  # a model, a plot, ... whose extra is not installed: the message names it
        print(f"error: {e}", file=sys.stderr)
        return 2

