"""The project's performance targets, measured: ``python -m pergrad_viz bench --targets``.

Each target is a ratio of two rows of one side-by-side table (both timed in the same interleaved rounds), so
machine load moves both alike. The report prints every table it used, then one line per target: the ratio
measured, the goal, and whether it was met: issue 21's table ("Performance III": the Jacobian and gradients of the
tutorial MLP against the loop and a hand-written vmap, a fresh result against ``out=``, every ``bench --model``
model against the hand-written vmap, the scan's throughput, ghost norms), the per-call check's cost (issue 16), then
the goals of earlier rounds. Issue 26's come first: the tutorial MLP against a plain forward+backward and the loop,
the seed's Jacobian against ``vmap(jacrev)`` and the loop, every ``bench --model`` model at B=16 and B=32 against
the hand-written ``vmap(grad(functional_call))`` (and the fine-tuned ones against forward+backward plus the memory
floor), and the per-call check's amortised share of ``auto``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pergrad_viz.bench import problems as bench_models
from pergrad_viz.bench.records import FORWARD_BACKWARD, FRESH, MEMORY_FLOOR, Record, check_cost, format_table
from pergrad_viz.bench.sweeps import compare
from pergrad_viz.errors import MissingExtraError


@dataclass
class Goal:
    """A ratio of rows of one table (``ratio(rows)``, None if a row is missing) compared with ``goal``."""

    setting: str
    what: str
    ratio: Callable[[dict[str, Record]], float | None]
    goal: float
    at_least: bool  # True: ratio >= goal; False: ratio <= goal


def _t(rows: dict[str, Record], label: str) -> float | None:
    r = rows.get(label)
    return None if r is None else r.median_s


def _over(numerator: str, *denominator: str) -> Callable[[dict[str, Record]], float | None]:
    """median(numerator) / sum of median(denominator rows)."""

    def ratio(rows: dict[str, Record]) -> float | None:
        times = [_t(rows, numerator), *(_t(rows, d) for d in denominator)]
        return None if any(t is None for t in times) else times[0] / sum(times[1:])

    return ratio


def _hand(model, loss, x, y) -> tuple[str, Callable[[], object], str]:
    return HAND, lambda: bench_models.hand_written_vmap(model, loss, x, y), "vmap(grad(functional_call))"


HAND = "hand vmap"
FULL_MODELS = ("transformer", "resnet18", "lstm")  # every strategy's row and the norms beside the hand-written vmap


class _Tables(dict):
    """{setting: records} that hands each table to ``emit`` as it is measured (a long run shows its progress, and
    what was measured survives an interrupted one)."""

    def __init__(self, emit: Callable[[str], None] | None):
        super().__init__()
        self.emit = emit

    def __setitem__(self, setting: str, records: list[Record]) -> None:
        super().__setitem__(setting, records)
        if self.emit is not None:
            self.emit(f"## {setting}\n{format_table(records)}\n")


def measure_tables(min_run_time: float, scan_examples: int = 2048, models: tuple[str, ...] | None = None,
                   emit: Callable[[str], None] | None = None) -> dict[str, list[Record]]:
    """The tables the goals are read from: {setting: records}, each timed in its own interleaved rounds
    (``models``: the ``bench --model`` models to measure, default all)."""
    tables: dict[str, list[Record]] = _Tables(emit)
    kw = {"min_run_time": min_run_time}
    model, loss, x, y = bench_models.setting(64, 20)
    tables["MLP(784, 20, 10) grads B=64"] = compare(model, loss, x, y, strategies=["loop", "auto"], **kw)
    model, loss, x, y = bench_models.setting(2, 20)
    jacrev = (HAND, lambda m=model, a=x: bench_models.hand_written_jacrev(m, a), "vmap(jacrev(functional_call))")
    tables["MLP(784, 20, 10) jacobian B=2"] = compare(model, loss, x, y, quantity="jacobian",
                                                          strategies=["loop", "auto"], extras=[jacrev], **kw)
    model, loss, x, y = bench_models.setting(64, 512)
    tables["MLP(784, 512, 10) grads B=64"] = compare(model, loss, x, y, strategies=["auto"], out_buffer=True,
                                                         norms=True, **kw)
    for name in bench_models.MODELS if models is None else models:
        try:
            model, loss, x, y = bench_models.problem(name, 16)
        except MissingExtraError as e:  # its library not installed (torchvision, transformers): its goals not measured
            if emit is not None:
                emit(f"## {name}: skipped ({e})\n")
            continue
        tables[f"{name} grads B=16"] = compare(model, loss, x, y, strategies=["auto"], flat=True,
                                               extras=[_hand(model, loss, x, y)], slow_limit=10**9, **kw)
        model, loss, x, y = bench_models.problem(name, 32)
        full = name in FULL_MODELS
        records = compare(model, loss, x, y, strategies=["loop", "torch_func", "auto"] if full else ["auto"],
                                flat=True, norms=full, extras=[_hand(model, loss, x, y)], slow_limit=10**9, **kw)
        tables[f"{name} grads B=32"] = records
        if name == "resnet18":
            # torch_func against the same vmap written by hand, the two alone in their rounds: between the loop's
            # and the other methods' 1.33 GiB results, these 2-second calls swing by 30% (IQR) in the table above.
            tables["resnet18 vmaps alone B=32"] = compare(
                model, loss, x, y, strategies=["torch_func"], flat=True, extras=[_hand(model, loss, x, y)],
                slow_limit=10**9, **kw)
            # The same model and batch again: into a preallocated buffer, and fresh.
            tables["resnet18 grads B=32 out="] = compare(model, loss, x, y, strategies=["auto"], out_buffer=True, **kw)
    if scan_examples:
        for name in ("cnn", "mlp"):
            tables[f"scan {name}, 1 process"] = _scan_table(name, scan_examples)
    return tables


def _scan_table(model: str, examples: int) -> list[Record]:
    """A whole-dataset scan (grad norms) beside a plain forward+backward over the same examples, interleaved
    rounds (:func:`pergrad_viz.bench.scans.throughput`), as records (times: each method's median loop seconds)."""
    from pergrad_viz.bench import scans as scan_bench

    threads = torch.get_num_threads()
    try:
        rows = scan_bench.throughput(model, n=examples, processes=(1,), rounds=3, threads=threads)
    finally:
        torch.set_num_threads(threads)
    return [Record(r["method"], "scan", r["batch"], None, r["loop_s"], None, 0,
                   note=f"{r['examples_per_s']:.0f} examples/s over {r['examples']}") for r in rows]


def _fresh_over_out(rows: dict[str, Record]) -> float | None:
    return _over(FRESH, "auto")(rows)


# Issue 26 ("Trust at the cost of the work"), its targets in order; then issue 21's ("Performance III") and the goals
# of earlier rounds, still held.
_SIZES = (16, 32)
GOALS = [
    Goal("MLP(784, 20, 10) grads B=64", "auto / forward+backward", _over("auto", FORWARD_BACKWARD), 2, False),
    Goal("MLP(784, 20, 10) grads B=64", "loop / auto", _over("loop", "auto"), 30, True),
    Goal("MLP(784, 20, 10) jacobian B=2", "hand vmap(jacrev) / auto", _over(HAND, "auto"), 2, True),
    Goal("MLP(784, 20, 10) jacobian B=2", "loop / auto", _over("loop", "auto"), 5, True),
    *[Goal(f"{name} grads B={b}", "hand vmap / auto", _over(HAND, "auto"), 1.2, True)
      for name in bench_models.MODELS for b in _SIZES],
    *[Goal(f"{name} grads B={b}", "auto / (forward+backward + memory floor)",
           _over("auto", FORWARD_BACKWARD, MEMORY_FLOOR), 1.6, False)
      for name in bench_models.FINE_TUNED for b in _SIZES],
    *[Goal(f"{name} grads B={b}", "check cost (auto - auto verify=False) / auto", check_cost, 0.10, False)
      for name in bench_models.MODELS for b in _SIZES],
    Goal("MLP(784, 20, 10) grads B=64", "check cost (auto - auto verify=False) / auto", check_cost, 0.10, False),
    Goal("MLP(784, 512, 10) grads B=64", "auto fresh / auto (out=)", _fresh_over_out, 1.3, False),
    Goal("scan cnn, 1 process", "forward+backward / scan: grad norms (throughput)",
         _over(FORWARD_BACKWARD, "scan: grad norms"), 0.7, True),
    Goal("scan mlp, 1 process", "forward+backward / scan: grad norms (throughput)",
         _over(FORWARD_BACKWARD, "scan: grad norms"), 0.7, True),
    Goal("transformer grads B=32", "grad norms / forward+backward", _over("grad norms", FORWARD_BACKWARD), 1.1,
         False),
    Goal("resnet18 grads B=32", "grad norms / forward+backward", _over("grad norms", FORWARD_BACKWARD), 1.1, False),
    Goal("MLP(784, 512, 10) grads B=64", "grad norms / forward+backward", _over("grad norms", FORWARD_BACKWARD),
         1.1, False),
    Goal("transformer grads B=32", "torch_func / auto", _over("torch_func", "auto"), 2, True),
    Goal("lstm grads B=32", "loop / auto", _over("loop", "auto"), 3, True),
    Goal("resnet18 grads B=32", "loop / auto", _over("loop", "auto"), 1.5, True),
    Goal("resnet18 vmaps alone B=32", "torch_func / hand vmap", _over("torch_func", HAND), 1.1, False),
    Goal("resnet18 grads B=32 out=", "auto (out=) / (forward+backward + memory floor)",
         _over("auto", FORWARD_BACKWARD, MEMORY_FLOOR), 2, False),
    Goal("resnet18 grads B=32 out=", "auto fresh / auto (out=)", _fresh_over_out, 1.3, False),
]
NOT_HERE = [  # issue 21's rows measured elsewhere
    ("explorer B=256 / hidden 512", "settled after a change (first figure <= 1.5 s)", "<= 6 s",
     "the browser tests: pytest tests/e2e prints 'explorer latency' with each change against its target"),
]


def report(min_run_time: float = 0.5, scan_examples: int = 2048, models: tuple[str, ...] | None = None,
           emit: Callable[[str], None] | None = None) -> str:
    """Measure every goal's table and return the goal lines as text, after the tables unless ``emit`` was given
    (then each table goes to ``emit`` as soon as it is measured). ``scan_examples`` = 0: no scan tables;
    ``models``: a subset of the ``bench --model`` models; goals without their table print "not measured"."""
    start = time.perf_counter()
    tables = measure_tables(min_run_time, scan_examples, models, emit)
    lines = []
    if emit is None:
        for setting, records in tables.items():
            lines += [f"## {setting}", format_table(records), ""]
    rows_of = {s: {r.strategy: r for r in records} for s, records in tables.items()}
    header = f"{'setting':30s} {'ratio (same table, same rounds)':50s} {'measured':>9s} {'goal':>8s}  met"
    lines += ["## targets", header, "-" * len(header)]
    for goal in GOALS:
        ratio = goal.ratio(rows_of.get(goal.setting, {}))
        sign = ">=" if goal.at_least else "<="
        if ratio is None:
            lines.append(f"{goal.setting:30s} {goal.what:50s} {'-':>9s} {sign}{goal.goal:>6.3g}x  not measured")
            continue
        met = ratio >= goal.goal if goal.at_least else ratio <= goal.goal
        lines.append(f"{goal.setting:30s} {goal.what:50s} {ratio:>8.3g}x {sign}{goal.goal:>6.3g}x  "
                     f"{'yes' if met else 'NO'}")
    for setting, what, goal, where in NOT_HERE:
        lines.append(f"{setting:30s} {what:50s} {'-':>9s} {goal:>8s}  measured by {where}")
    lines.append(f"# measured in {time.perf_counter() - start:.0f} s, {torch.get_num_threads()} threads")
    return "\n".join(lines)
