"""Benchmark sweeps: strategies (and optional peers) x batch sizes x hidden widths on the tutorial
``MLP(784, hidden, 10)`` with real sample images (:func:`sweep`), or on the real architectures of
:mod:`pergrad_viz.bench.problems` (:func:`model_sweep`), timed side by side in interleaved rounds
(:func:`compare`, :func:`pergrad_viz.bench.timing.time_interleaved`; on CUDA synchronised before every clock
reading).

Results are plain :class:`Record` s; every ratio in a sweep comes from timings of that same run.
Two reference rows come with each setting: ``forward+backward`` (one ordinary batched loss backward
of the same model and batch) and ``memory floor`` (filling a preallocated tensor of the result's size:
writing the answer once is the least any method can do). Beside ``auto``, where it runs the model once on the
whole batch, ``auto verify=False``: the same call without the per-call check (:mod:`pergrad_viz.engine.certify`), whose
cost, (auto - auto verify=False) / auto, the ``auto`` row's note states; with ``out_buffer``, ``auto fresh``: the
same call allocating its result (page faults and all) beside ``auto`` writing into ``out=``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pergrad_viz.api import output_size, per_sample_grads, per_sample_jacobian, resolve_strategy
from pergrad_viz.bench import peers as peer_libs
from pergrad_viz.bench import problems
from pergrad_viz.bench.problems import setting
from pergrad_viz.bench.records import (
    FORWARD_BACKWARD,
    FRESH,
    MEMORY_FLOOR,
    UNCHECKED,
    Record,
    check_cost,
    failed_note,
)
from pergrad_viz.bench.timing import steady_checks, synchronizer, time_interleaved
from pergrad_viz.core.batch import Batch
from pergrad_viz.core.memory import result_bytes
from pergrad_viz.core.progress import progress_bar
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.core.validate import check_modes
from pergrad_viz.derived.norms import per_sample_grad_norms
from pergrad_viz.strategies import REGISTRY, STRATEGIES

QUANTITIES = ("grads", "jacobian")
SLOW = tuple(name for name, s in REGISTRY.items() if s.slow_baseline)  # B (x Y) backward passes


def backward_work(strategy: str, quantity: str, batch: int, outputs: int) -> int:
    """Samples pushed through backward passes in one call of a slow strategy (0 for the fast ones).

    The loop runs B (x Y for Jacobians) backward passes of one sample each; ``autograd_stack`` and
    ``batched_grad`` run as many passes, each over the whole batch: B times the work.
    """
    passes = batch * (outputs if quantity == "jacobian" else 1)
    if strategy == "loop":
        return passes
    return passes * batch if strategy in SLOW else 0


def _flat(result: dict[str, torch.Tensor] | torch.Tensor, batch: int, quantity: str = "grads") -> torch.Tensor:
    """A result as (B, numbers) in one layout: a dict's parameters side by side, as ``flat=True`` lays them out
    (a Jacobian's (B, Y, P): each output's row of every parameter, not each parameter's block of every output)."""
    if isinstance(result, torch.Tensor):
        return result.reshape(batch, -1)
    if quantity == "jacobian":
        outputs = next(iter(result.values())).shape[1]
        return torch.cat([t.reshape(batch, outputs, -1) for t in result.values()], dim=2).reshape(batch, -1)
    return torch.cat([t.reshape(batch, -1) for t in result.values()], dim=1)


def sweep(quantity: str = "grads", batch_sizes: Sequence[int] = (2, 32, 128), hiddens: Sequence[int] = (20,), *,
          strategies: Sequence[str] = STRATEGIES, peers: Sequence[str] = (), slow_limit: int = 20480,
          min_run_time: float = 0.2, flat: bool = False, out_buffer: bool = False, chunk_sizes: Sequence[int] = (),
          norms: bool = False, device: str = "cpu", dtype: torch.dtype = torch.float32, progress: bool = True,
          check: bool = True) -> list[Record]:
    """Time every strategy (and peer) at every (batch size, hidden width); returns plain records.

    Args:
        quantity: ``"grads"`` (per-sample gradients, MSE ``reduction='sum'``) or ``"jacobian"`` (B, Y, P).
        strategies: names from :data:`STRATEGIES` or ``"auto"``.
        peers: ``"opacus"`` and/or ``"backpack"`` (per-sample gradients only); each is checked for
            agreement with our result before it is timed, and left out (with a note) if it disagrees.
        slow_limit: ``loop``, ``autograd_stack`` and ``batched_grad`` are skipped (with a note saying
            so) when they would push more than this many samples through backward passes per call
            (see :func:`backward_work`).
        min_run_time: seconds of timing per method and setting, over all rounds (see :func:`compare`).
        flat, out_buffer: ask for one (B, P) tensor; with ``out_buffer`` into a preallocated one (``out=``).
        chunk_sizes, norms: extra rows, see :func:`compare`.
        check: compare every result with the first one computed (``max_abs_diff``).
    """
    if quantity not in QUANTITIES:
        raise ValueError(f"unknown quantity {quantity!r}; valid: {', '.join(QUANTITIES)}")
    if peers and quantity != "grads":
        raise ValueError("peers compute per-sample gradients only: use quantity='grads'")
    for name in strategies:
        if name != "auto" and name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}; valid: 'auto', {', '.join(STRATEGIES)}")
    settings = [(b, h) for h in hiddens for b in batch_sizes]
    per_setting = len(strategies) * (1 + len(chunk_sizes)) + len(peers) + 2 * norms + 4  # at most
    bar = _progress(len(settings) * per_setting, enabled=progress)
    records: list[Record] = []
    try:
        for batch, hidden in settings:
            model, loss_fn, x, y = setting(batch, hidden, device=device, dtype=dtype)
            records += compare(model, loss_fn, x, y, quantity=quantity, strategies=strategies, peers=peers,
                               slow_limit=slow_limit, min_run_time=min_run_time, flat=flat,
                               out_buffer=out_buffer, chunk_sizes=chunk_sizes, norms=norms, check=check,
                               hidden=hidden, bar=bar)
    finally:
        bar.close()
    return records


def model_sweep(model_name: str, batch_sizes: Sequence[int] = (32,), *, strategies: Sequence[str] = STRATEGIES,
                peers: Sequence[str] = (), slow_limit: int = 20480, min_run_time: float = 0.2, flat: bool = True,
                out_buffer: bool = False, norms: bool = False, device: str = "cpu",
                dtype: torch.dtype = torch.float32, progress: bool = True) -> list[Record]:
    """Per-sample gradients of a real architecture (:mod:`pergrad_viz.bench.problems`): every strategy, a hand-written
    ``vmap(grad(functional_call))`` (concatenated to (B, P)), peers where they run, and the reference rows."""
    per_setting = len(strategies) + len(peers) + 2 * norms + 5
    bar = _progress(len(batch_sizes) * per_setting, enabled=progress)
    records: list[Record] = []
    try:
        for batch in batch_sizes:
            model, loss_fn, x, y = problems.problem(model_name, batch, device=device, dtype=dtype)
            hand = ("hand vmap", functools.partial(problems.hand_written_vmap, model, loss_fn, x, y),
                    "vmap(grad(functional_call)) + torch.cat, as users write it")
            records += compare(model, loss_fn, x, y, quantity="grads", strategies=strategies, peers=peers,
                               slow_limit=slow_limit, min_run_time=min_run_time, flat=flat, out_buffer=out_buffer,
                               norms=norms, extras=[hand], bar=bar)
    finally:
        bar.close()
    for r in records:
        r.note = f"{model_name}; {r.note}" if r.note else model_name
    return records


def _progress(total: int, enabled: bool):
    return progress_bar(total=total, desc="benchmark", unit="method", disable=not enabled, leave=False)


@dataclass
class _Method:
    label: str
    fn: Callable[[], object] | None  # None: skipped, see note
    note: str = ""
    kind: str = "result"  # methods of one kind are checked against each other
    peer: bool = False


def compare(model: nn.Module, loss_fn: nn.Module | None, inputs: torch.Tensor, targets: torch.Tensor | None, *,
            quantity: str = "grads", strategies: Sequence[str] = STRATEGIES, peers: Sequence[str] = (),
            slow_limit: int = 20480, min_run_time: float = 0.2, flat: bool = False, out_buffer: bool = False,
            chunk_sizes: Sequence[int] = (), norms: bool = False, check: bool = True, hidden: int | None = None,
            extras: Sequence[tuple[str, Callable[[], object], str]] = (), rounds: int = 7, bar=None) -> list[Record]:
    """Time strategies (and peers) side by side on any model and batch, plus the two reference rows.

    ``loss_fn`` and ``targets`` are needed for ``quantity="grads"`` and for the forward+backward row
    (for Jacobians without them, the reference backward is of the summed outputs). ``hidden`` only labels
    the records. ``chunk_sizes`` adds a row per fast strategy and chunk size (``"hooks chunk=32"``);
    ``norms`` (gradients only) adds ``grad norms`` (:func:`pergrad_viz.per_sample_grad_norms`) and
    ``grads + norm`` (materialise (B, P), then ``.norm(dim=1)``), checked against each other.
    ``extras`` are more (label, no-argument function, note) rows, checked against the strategies' result (e.g. a
    hand-written ``vmap``).
    Every method and both reference rows are timed in ``rounds`` interleaved rounds
    (:func:`pergrad_viz.bench.timing.time_interleaved`, blocks of about ``min_run_time / rounds`` seconds): medians and
    interquartile ranges over the rounds; a row whose IQR exceeds 25% of its median says ``NOISY ... rerun``.
    Returns the methods' records, then ``forward+backward`` and ``memory floor``.
    """
    batch = inputs.shape[0]
    trainable = Trainable.of(model)
    check_modes(trainable)  # before the model runs (BatchNorm in training mode would update its statistics)
    flat = flat or out_buffer
    outputs = output_size(trainable, Batch.of(inputs)) if quantity == "jacobian" else 1
    nbytes = result_bytes(batch, trainable.num_params, trainable.dtype, outputs)
    shape = (batch, trainable.num_params) if outputs == 1 else (batch, outputs, trainable.num_params)
    kw = {"dtype": trainable.dtype, "device": trainable.device}
    out = torch.empty(shape, **kw) if out_buffer else None
    methods = _methods(quantity, model, loss_fn, inputs, targets, trainable, strategies, peers, slow_limit, outputs,
                       flat, out, chunk_sizes, norms)
    methods[len(strategies):len(strategies)] = [_Method(label, fn, note) for label, fn, note in extras]
    bar = bar if bar is not None else _progress(len(methods) + 2, enabled=False)

    def forward_backward() -> object:
        output = model(inputs)
        loss = output.sum() if loss_fn is None or targets is None else loss_fn(output, targets)
        return torch.autograd.grad(loss, trainable.params, allow_unused=True)

    timed: dict[str, tuple[Callable[[], object], int, dict]] = {
        FORWARD_BACKWARD: (forward_backward, nbytes, {}),
        MEMORY_FLOOR: (functools.partial(torch.empty(shape, **kw).fill_, 0.5), nbytes, {}),
    }
    rows = _checked_rows(methods, timed, quantity, batch, hidden, trainable.dtype, nbytes, check, bar)
    steady_checks(model, [fn for label, (fn, _, _) in timed.items() if label.startswith("auto")])
    # All methods and both reference rows in interleaved rounds: a stall of the machine hits them alike.
    bar.set_postfix_str(f"B={batch}: {len(timed)} methods, {rounds} interleaved rounds")
    timings = time_interleaved({label: fn for label, (fn, _, _) in timed.items()}, rounds=rounds,
                               min_block_s=min_run_time / rounds, synchronize=synchronizer(trainable.device))
    bar.update(len(timed))
    return _records(timed, timings, rows, quantity, batch, hidden)


def _checked_rows(methods: list[_Method], timed: dict, quantity: str, batch: int, hidden: int | None,
                  dtype: torch.dtype, nbytes: int, check: bool, bar) -> list[Record | str]:
    """Each method run once and checked against the first result of its kind (a peer that fails or disagrees is not
    timed, its row says why); the methods to time go into ``timed``. Returns the rows in table order: a
    :class:`Record` (not timed) or the label of a timed method."""
    rows: list[Record | str] = []  # a Record (not timed) or the label of a timed method, in table order
    references: dict[str, torch.Tensor] = {}
    for m in methods:
        size = result_bytes(batch, 1, dtype) if m.kind == "norms" else nbytes
        if m.fn is None:
            rows.append(Record(m.label, quantity, batch, hidden, None, None, size, note=m.note))
            bar.update()
            continue
        diff = None
        if check or m.peer:
            try:
                result = _flat(m.fn(), batch, quantity).clone()
            except Exception as e:  # a peer that cannot run this model
                if not m.peer:
                    raise
                rows.append(Record(m.label, quantity, batch, hidden, None, None, size,
                                   note=failed_note(e)))
                bar.update()
                continue
            reference = references.setdefault(m.kind, result)
            if m.peer and result.shape != reference.shape:  # e.g. Opacus' (1, ...) grads of shared position ids
                rows.append(Record(m.label, quantity, batch, hidden, None, None, size,
                                   note=f"not timed: {result.numel():,} numbers, not {reference.numel():,}"))
                bar.update()
                continue
            diff = (result - reference).abs().max().item()
            if m.peer and diff > 1e-4 * max(1.0, reference.abs().max().item()):
                rows.append(Record(m.label, quantity, batch, hidden, None, None, size, max_abs_diff=diff,
                                   note=f"not timed: disagrees with pergrad_viz by {diff:.2e}"))
                bar.update()
                continue
        timed[m.label] = (m.fn, size, {"max_abs_diff": diff, "note": m.note})
        rows.append(m.label)
    # The checked results are let go before the timing: held, they swung the timing of large results (ResNet-18's
    # 1.33 GiB) by 40-70% (IQR) through the allocator and page faults.
    references.clear()
    return rows


def _records(timed: dict, timings: dict, rows: list[Record | str], quantity: str, batch: int,
             hidden: int | None) -> list[Record]:
    """The table: the methods' records in order (ratios to the loop, forward+backward and the memory floor), then
    the two reference rows."""
    records: dict[str, Record] = {}
    for label, (_fn, size, fields) in timed.items():
        t = timings[label]
        note = fields.get("note") or ""
        if t.noisy:
            note = f"NOISY: IQR {t.spread:.0%} of the median, rerun" + (f"; {note}" if note else "")
        records[label] = Record(label, quantity, batch, hidden, t.median_s, t.iqr_s, size,
                                max_abs_diff=fields.get("max_abs_diff"), note=note, noisy=t.noisy)
    fb, floor = records[FORWARD_BACKWARD], records[MEMORY_FLOOR]
    rows = [records[r] if isinstance(r, str) else r for r in rows]
    loop_time = next((r.median_s for r in rows if r.strategy == "loop" and not r.skipped), None)
    for r in [fb, floor, *rows]:
        if r.skipped:
            continue
        r.speedup_vs_loop = loop_time / r.median_s if loop_time else None
        r.vs_forward_backward = r.median_s / fb.median_s
        r.vs_memory_floor = r.median_s / floor.median_s
    cost = check_cost({r.strategy: r for r in rows})
    if cost is not None:
        auto = next(r for r in rows if r.strategy == "auto")
        auto.note = f"{auto.note}; check {cost:.0%} of the call" if auto.note else f"check {cost:.0%} of the call"
    return [*rows, fb, floor]


def _methods(quantity, model, loss_fn, inputs, targets, trainable, strategies, peers, slow_limit, outputs, flat, out,
             chunk_sizes, norms) -> list[_Method]:
    batch = inputs.shape[0]
    methods = []
    for name in strategies:
        strategy = resolve_strategy(name, trainable, inputs)
        note = f"auto = {strategy}" if name == "auto" else ""
        work = backward_work(strategy, quantity, batch, outputs)
        if work > slow_limit:
            methods.append(_Method(name, None, f"skipped: {work:,} sample-backward passes > slow_limit={slow_limit:,}"))
            continue
        methods.append(_Method(name, _strategy_call(quantity, name, model, loss_fn, inputs, targets, flat, out), note))
        if name == "auto" and REGISTRY[strategy].batched_forward:
            methods.append(_Method(UNCHECKED, _strategy_call(quantity, name, model, loss_fn, inputs, targets, flat, out,
                                                             verify=False), "auto without the per-call check"))
        if name == "auto" and out is not None:
            methods.append(_Method(FRESH, _strategy_call(quantity, name, model, loss_fn, inputs, targets, flat, None),
                                   "auto allocating its result (no out=)"))
        if strategy not in SLOW:
            for c in chunk_sizes:
                methods.append(_Method(f"{name} chunk={c}", _strategy_call(quantity, name, model, loss_fn, inputs,
                                                                          targets, flat, out, chunk_size=c), note))
    for name in peers:
        try:
            methods.append(_Method(name, peer_libs.make_peer(name, model, loss_fn, inputs, targets), peer=True))
        except Exception as e:  # e.g. a layer the peer does not support
            methods.append(_Method(name, None, failed_note(e)))
    if norms and quantity == "grads":
        methods.append(_Method("grad norms", lambda: per_sample_grad_norms(model, loss_fn, inputs, targets),
                               "pv.per_sample_grad_norms: (B,) norms", kind="norms"))
        methods.append(_Method("grads + norm", lambda: per_sample_grads(model, loss_fn, inputs, targets, flat=True)
                               .norm(dim=1), "per_sample_grads(flat=True).norm(dim=1)", kind="norms"))
    return methods


def _strategy_call(quantity, strategy, model, loss_fn, x, y, flat, out, chunk_size=None,
                   verify=True) -> Callable[[], object]:
    if quantity == "grads":
        return lambda: per_sample_grads(model, loss_fn, x, y, strategy=strategy, flat=flat, out=out,
                                        chunk_size=chunk_size, verify=verify)
    return lambda: per_sample_jacobian(model, x, strategy=strategy, flat=flat, out=out, chunk_size=chunk_size,
                                       verify=verify)
