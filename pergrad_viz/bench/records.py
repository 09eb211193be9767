"""Benchmark records and how they are shown: :class:`Record` (one timed or skipped method at one setting), the
names of the reference rows, and the plain-text table and CSV of a run. Plain data: plots and the explorer read
these without importing the benchmarks themselves."""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pergrad_viz.errors import human_bytes

FORWARD_BACKWARD = "forward+backward"
MEMORY_FLOOR = "memory floor"
UNCHECKED = "auto verify=False"  # auto without the per-call check (engine.certify): the check's cost is the gap
FRESH = "auto fresh"  # with --out-buffer: the same call allocating its result, beside auto writing into out=
FAILED = "failed: "  # the note of a method that raised instead of computing (a peer, an explorer strategy)


def failed_note(e: BaseException, limit: int = 60) -> str:
    """The note of a method that raised ``e``: ``failed: Type: the message's first line`` (cut at ``limit``)."""
    lines = str(e).strip().splitlines()
    first = lines[0] if lines else ""
    return f"{FAILED}{type(e).__name__}: {first if len(first) <= limit else first[:limit - 1] + '…'}"


@dataclass
class Record:
    """One timed (or skipped) method at one setting. Times in seconds; ratios from the same run."""

    strategy: str
    quantity: str
    batch_size: int
    hidden: int | None  # None for a model that is not the benchmark MLP
    median_s: float | None
    iqr_s: float | None
    result_bytes: int
    speedup_vs_loop: float | None = None  # loop time / this time
    vs_forward_backward: float | None = None  # this time / plain forward+backward time
    vs_memory_floor: float | None = None  # this time / time to fill a result-sized tensor
    max_abs_diff: float | None = None  # largest difference from the reference result
    note: str = ""
    noisy: bool = False  # the timing's spread stayed too large to trust it (the note says how large)

    @property
    def skipped(self) -> bool:
        return self.median_s is None


def check_cost(rows: dict[str, Record]) -> float | None:
    """The per-call check's share of an ``auto`` call, (auto - auto verify=False) / auto, from one table's rows
    (None where either row is missing or skipped)."""
    auto, unchecked = rows.get("auto"), rows.get(UNCHECKED)
    if auto is None or unchecked is None or auto.skipped or unchecked.skipped:
        return None
    return (auto.median_s - unchecked.median_s) / auto.median_s


def fmt_seconds(s: float) -> str:
    """A duration as people read it: ``"1.5 s"``, ``"13.7 ms"``, ``"95.7 µs"``, ``"939 ns"`` (3 digits); a dash for a
    time that is not one (NaN, negative)."""
    if not s >= 0:
        return "-"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns"


def fmt_ratio(r: float) -> str:
    """A ratio as people read it: ``"1,930x"``, ``"89.4x"``, ``"0.668x"`` (never ``1.93e+03x``); a dash for what is
    not one (NaN, infinite, negative)."""
    if not (math.isfinite(r) and r >= 0):
        return "-"
    return f"{r:,.0f}x" if r >= 100 else f"{r:.3g}x"


def _or_dash(fmt: Callable[[float], str], value: float | None) -> str:
    return "-" if value is None else fmt(value)


COLUMNS = ("quantity", "batch", "hidden", "method", "median", "IQR", "vs loop", "vs fwd+bwd", "vs floor",
           "result", "max |diff|", "note")


def table_rows(records: Iterable[Record]) -> list[tuple[str, ...]]:
    """The records as rows of strings, in :data:`COLUMNS` order."""
    return [(r.quantity, str(r.batch_size), "-" if r.hidden is None else str(r.hidden), r.strategy,
             _or_dash(fmt_seconds, r.median_s), _or_dash(fmt_seconds, r.iqr_s), _or_dash(fmt_ratio, r.speedup_vs_loop),
             _or_dash(fmt_ratio, r.vs_forward_backward), _or_dash(fmt_ratio, r.vs_memory_floor),
             human_bytes(r.result_bytes),
             "-" if r.max_abs_diff is None else f"{r.max_abs_diff:.1e}", r.note)
            for r in records]


def format_table(records: Iterable[Record]) -> str:
    """An aligned plain-text table; "vs loop" is a speed-up, "vs fwd+bwd" and "vs floor" are time ratios."""
    rows = [COLUMNS, *table_rows(records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    right = {1, 2, 4, 5, 6, 7, 8, 9, 10}
    lines = []
    for k, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_csv(records: Iterable[Record], path: str) -> None:
    """One row per record, with the :class:`Record` field names as header."""
    fields = [f.name for f in dataclasses.fields(Record)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for r in records:
            writer.writerow(dataclasses.asdict(r))
