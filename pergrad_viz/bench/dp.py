"""``bench --dp``: the DP-SGD gradient of one batch, seven rows, in one interleaved table per model.

Rows: a plain forward+backward (``loss.backward()`` into ``.grad``: the cost to beat); this package's clipped sum
(:func:`pergrad_viz.clipped_grad_sum` as called by default, i.e. with its per-call check, timed with the check's
account as a long training loop has it (:func:`~pergrad_viz.bench.timing.steady_checks`); then with the noise of
sigma = 1, as :func:`pergrad_viz.dp_step` draws it; and with ``verify=False``); the noise alone (P numbers from
torch's generator: on CPUs a serial draw of about 5 ns a number, whatever computes the clipped sum; Opacus draws the
same in ``optimizer.step()``); the materialised route (:func:`pergrad_viz.per_sample_grads`, then
:func:`pergrad_viz.dp_sgd_gradient`); Opacus' ghost clipping (``GradSampleModuleFastGradientClipping``, two
backward passes) where opacus is installed. The rows without noise compute the same sum as Opacus' row.
Columns: median time and IQR over interleaved rounds, time / plain (the median of each round's ratio),
peak memory and peak / plain's, max |diff| of the noiseless clipped sum from the loop reference (the package's loop
strategy, clipped and summed).

Peak memory, two columns: ``tensors``, the most bytes of tensors alive at once during the call above those alive at
its start (on CUDA the allocator's peak, ``torch.cuda.max_memory_allocated``; on CPUs from the allocation records of
``torch.profiler`` with ``profile_memory=True``, every tensor allocation and free in order): exact and repeatable, what
the targets are read from; ``RSS``, on Linux CPUs the process's peak resident memory above its level at the start of
the call (``VmHWM`` reset through ``/proc/self/clear_refs``, with glibc's ``malloc_trim`` before and a fixed mmap
threshold of 128 KiB during the measurement, so that freed tensors leave the resident set; the memory is measured
before the times, which are taken under the heap settings of a warm training loop instead, :func:`_allocator`), which
also counts the allocator's slack and Python's objects (for models of a few MB it moves with the heap's state);
elsewhere a dash.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import gc
import os
import sys
import warnings
from collections.abc import Callable

import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.bench import peers, problems
from pergrad_viz.bench.timing import paired_ratio, steady_checks, time_interleaved
from pergrad_viz.core.losses import causal_lm_loss
from pergrad_viz.core.process import NO_BATCHING_RULE
from pergrad_viz.tutorial.networks import MLP

DP_MODELS: tuple[str, ...] = ("mlp", "transformer", "resnet18", "gpt2", "bert", "lora-llama")
NOISED = "pv + noise (sigma=1)"  # the clipped sum with its noise, as pv.dp_step draws it
NOISE = "the noise alone"
MAX_NORM = 1.0
SIGMA = 1.0


def dp_problem(name: str, batch: int, device: str = "cpu") -> tuple[nn.Module, Callable, object, torch.Tensor]:
    """(model, loss_fn with reduction='sum', inputs, targets): ``mlp`` is MLP(784, 512, 10) on the bundled images,
    the others :func:`pergrad_viz.bench.problems.problem` at this batch size."""
    if name != "mlp":
        return problems.problem(name, batch, device=device)
    _, _, x, _ = problems.setting(batch, 20, device=device)
    torch.manual_seed(0)
    y = torch.randint(0, problems.CLASSES, (batch,), generator=torch.Generator().manual_seed(0)).to(device)
    return MLP(784, 512, 10).to(device), nn.CrossEntropyLoss(reduction="sum"), x, y


class _PerSampleCriterion:
    """A loss Opacus' ghost clipping can call: it sets ``reduction`` to 'none' to get the (B,) per-sample losses."""

    def __init__(self, loss_fn: Callable):
        self.loss_fn = loss_fn
        self.reduction = "sum"

    def __call__(self, output, targets):
        if isinstance(self.loss_fn, nn.Module):
            self.loss_fn.reduction = self.reduction
            return self.loss_fn(output, targets)
        return causal_lm_loss(output, targets, reduction=self.reduction)


def opacus_ghost(model: nn.Module, loss_fn: Callable, x, y, max_norm: float) -> Callable[[], dict]:
    """A no-argument step of Opacus' ghost clipping on a copy of ``model``: the clipped sum into ``.grad`` (noise
    off, so that it can be compared), returned as {name: grad}."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping
    from opacus.optimizers import DPOptimizerFastGradientClipping
    from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

    net = copy.deepcopy(model)
    if any(isinstance(m, nn.MultiheadAttention) for m in net.modules()):  # Opacus' hooks cannot see inside it
        from opacus.validators import ModuleValidator

        net = ModuleValidator.fix(net)  # DPMultiheadAttention, the same weights under other names
    gsm = GradSampleModuleFastGradientClipping(net, batch_first=True, loss_reduction="sum",
                                               max_grad_norm=max_norm, use_ghost_clipping=True, strict=False)
    # Opacus records activations in training mode only: where eval differs from training only in Dropout of p=0
    # (and there is no BatchNorm), training mode computes the same function.
    same = all(not isinstance(m, nn.modules.batchnorm._BatchNorm) and not (isinstance(m, nn.Dropout) and m.p > 0)
               for m in net.modules())
    if not model.training and not same:
        raise NotImplementedError("Opacus records in training mode only, where this model (Dropout, BatchNorm) "
                                  "computes another function")
    gsm.train()
    params = [(n.removeprefix("_module."), p) for n, p in gsm.named_parameters() if p.requires_grad]
    optimizer = DPOptimizerFastGradientClipping(torch.optim.SGD([p for _, p in params], lr=0.0), noise_multiplier=0.0,
                                                max_grad_norm=max_norm, expected_batch_size=y.shape[0],
                                                loss_reduction="sum")
    criterion = DPLossFastGradientClipping(gsm, optimizer, _PerSampleCriterion(copy.deepcopy(loss_fn)),
                                           loss_reduction="sum")

    def run() -> dict:
        optimizer.zero_grad()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            criterion(gsm(x), y).backward()
        return {n: p.grad for n, p in params}

    return run


_LIBC = None


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
STEADY_MMAP = 32 << 20  # glibc's dynamic mmap threshold's ceiling (64-bit): a training loop's regime once warm


def _libc():
    global _LIBC
    if _LIBC is None and sys.platform.startswith("linux"):
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
        except OSError:
            _LIBC = False
    return _LIBC


DIFFERS = 1e-3  # a sum further than this from the loop's (element-wise) is another result, not rounding


def _allocator(measuring_memory: bool) -> None:
    """glibc's heap for the next measurements. Memory: a fixed mmap threshold of 128 KiB, so that a freed tensor
    leaves the resident set (RSS peaks then count what a call holds, not what the heap kept). Time: the regime of a
    warm training loop under glibc's defaults (its dynamic threshold grown to its 32 MiB ceiling, trimming at twice
    that), where freed blocks are reused without page faults; timing under the memory setting made every fresh
    tensor fault its pages in, which slowed the plain step most (1.5-1.9x) and understated every ratio."""
    libc = _libc()
    if libc:
        mmap = 128 << 10 if measuring_memory else STEADY_MMAP
        libc.mallopt(M_MMAP_THRESHOLD, mmap)
        libc.mallopt(M_TRIM_THRESHOLD, 2 * mmap)


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise OSError(key)


def peak_bytes(fn: Callable[[], object], device: str) -> int | None:
    """The peak memory one call of ``fn`` adds (see the module docstring), or None where it cannot be read."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
    libc = _libc()
    if not libc:
        return None
    _allocator(measuring_memory=True)
    try:
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        start = _status_bytes("VmRSS:")
        fn()
        return _status_bytes("VmHWM:") - start
    except OSError:
        return None
    finally:
        _allocator(measuring_memory=False)


@contextlib.contextmanager
def _quiet_stderr():
    """File descriptor 2 to /dev/null for the block (what C++ code prints there), restored after."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def tensor_peak_bytes(fn: Callable[[], object], device: str) -> int | None:
    """The most bytes of tensors alive at once during one call of ``fn``, above those alive at its start (see the
    module docstring), or None where it cannot be read."""
    gc.collect()
    if device.startswith("cuda"):
        return peak_bytes(fn, device)
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():  # the profiler's own lines (C++, file descriptor 2): start, stop, blocks freed unseen
        prof.start()
        try:
            fn()
        finally:
            prof.stop()
    records = getattr(prof.profiler, "kineto_results", None)
    if records is None:
        return None
    changes = sorted((e.start_ns(), e.nbytes()) for e in records.events() if e.name() == "[memory]")
    live = peak = 0
    for _, change in changes:
        live += change
        peak = max(peak, live)
    return peak


def _max_diff(got: dict, want: dict) -> float | None:
    """Over the parameters both name (a peer may rename some, e.g. DPMultiheadAttention's)."""
    common = [n for n in want if n in got and got[n] is not None]
    return max((float((got[n].detach() - want[n]).abs().max()) for n in common), default=None)


def dp_table(name: str, *, batch: int = 32, rounds: int = 5, device: str = "cpu") -> list[dict]:
    """One bench model's rows (:func:`dp_problem`), as :func:`dp_rows`."""
    return dp_rows(*dp_problem(name, batch, device), rounds=rounds, device=device)


def dp_rows(model: nn.Module, loss_fn: Callable, x, y: torch.Tensor, *, rounds: int = 5, device: str = "cpu"
            ) -> list[dict]:
    """The DP-SGD gradient of this batch (inputs ``x``, targets ``y``; B samples) in seven rows, timed in ``rounds``
    interleaved rounds: {method, median_s, iqr, vs_plain, peak, peak_vs_plain, tensors, tensors_vs_plain,
    max_diff, note} per row (see the module docstring), ``peak`` and ``tensors`` in bytes. Any model and loss
    :func:`pergrad_viz.clipped_grad_sum` takes (a mean or a sum over the batch: the plain row backpropagates
    ``loss_fn(model(x), y)``); ``.grad`` is left as it was."""
    named = [p for p in model.parameters() if p.requires_grad]
    saved = [p.grad for p in named]
    try:
        with warnings.catch_warnings():  # torch.func's note on the materialised row's vmap of attention
            warnings.filterwarnings("ignore", message=NO_BATCHING_RULE)
            return _rows(model, loss_fn, x, y, rounds, device)
    finally:
        for p, grad in zip(named, saved, strict=True):
            p.grad = grad


def _rows(model: nn.Module, loss_fn: Callable, x, y: torch.Tensor, rounds: int, device: str) -> list[dict]:
    _allocator(measuring_memory=True)  # the first calls (the diffs) and the memory on a lean heap, then the times
    generator = torch.Generator(device=device).manual_seed(0)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def plain():
        for _, p in named:
            p.grad = None
        loss_fn(model(x), y).backward()

    noiseless = {
        "pv clipped_grad_sum": lambda: pv.clipped_grad_sum(model, loss_fn, x, y, MAX_NORM),
        "pv, verify=False": lambda: pv.clipped_grad_sum(model, loss_fn, x, y, MAX_NORM, verify=False),
        "materialised + clip": lambda: pv.dp_sgd_gradient(pv.per_sample_grads(model, loss_fn, x, y), MAX_NORM, 0.0),
    }
    methods: dict[str, Callable[[], object]] = {
        "forward+backward": plain,
        "pv clipped_grad_sum": noiseless["pv clipped_grad_sum"],
        NOISED: lambda: pv.clipped_grad_sum(model, loss_fn, x, y, MAX_NORM, noise_multiplier=SIGMA,
                                            generator=generator),
        NOISE: lambda: [torch.empty_like(p).normal_(0.0, SIGMA * MAX_NORM, generator=generator) for _, p in named],
        "pv, verify=False": noiseless["pv, verify=False"],
        "materialised + clip": noiseless["materialised + clip"],
    }
    notes: dict[str, str] = {NOISE: "P numbers of N(0, sigma^2 C^2), torch's generator"}
    if peers.available("opacus"):
        try:
            run = opacus_ghost(model, loss_fn, x, y, MAX_NORM)
            run()
            methods["opacus ghost clipping"] = noiseless["opacus ghost clipping"] = run
            renamed = {n for n, p in model.named_parameters() if p.requires_grad} - set(run())
            if renamed:
                notes["opacus ghost clipping"] = f"diff without {len(renamed)} renamed parameters"
        except Exception as e:  # noqa: BLE001 - a peer that cannot run this model is a row with a note
            notes["opacus ghost clipping"] = f"failed: {type(e).__name__}: {str(e)[:60]}"
    else:
        notes["opacus ghost clipping"] = "not installed: pip install opacus (the peers extra)"
    want = pv.dp_sgd_gradient(pv.per_sample_grads(model, loss_fn, x, y, strategy="loop"), MAX_NORM, 0.0)
    diffs = {m: _max_diff(fn(), want) for m, fn in noiseless.items()}
    plain()
    peaks, tensors = _memory(methods, [p for _, p in named], device)
    steady_checks(model, [noiseless["pv clipped_grad_sum"]])
    _allocator(measuring_memory=False)
    timings = time_interleaved(methods, rounds=rounds)
    base_m = peaks["forward+backward"]
    base_tensors = tensors["forward+backward"]
    rows = []
    for m in [*methods, *(k for k in notes if k not in methods)]:
        t = timings.get(m)
        rows.append({
            "method": m, "median_s": None if t is None else t.median_s,
            "iqr": None if t is None else t.spread,
            "vs_plain": None if t is None else paired_ratio(t, timings["forward+backward"]),
            "vs_pv": None if t is None else paired_ratio(t, timings["pv clipped_grad_sum"]), "peak": peaks.get(m),
            "peak_vs_plain": None if peaks.get(m) is None or not base_m else peaks[m] / base_m,
            "tensors": tensors.get(m),
            "tensors_vs_plain": None if tensors.get(m) is None or not base_tensors else tensors[m] / base_tensors,
            "max_diff": diffs.get(m),
            "note": "; ".join(filter(None, ("NOISY" if t is not None and t.noisy else "", notes.get(m, "")))),
        })
    return rows


def _memory(methods: dict[str, Callable[[], object]], params: list[torch.Tensor], device: str
            ) -> tuple[dict[str, int | None], dict[str, int | None]]:
    """({method: RSS peak bytes}, {method: tensor peak bytes}), each method starting without ``.grad``, as after
    ``zero_grad(set_to_none=True)``."""
    peaks, tensors = {}, {}
    for m, fn in methods.items():
        for p in params:
            p.grad = None
        peaks[m] = peak_bytes(fn, device)
        for p in params:
            p.grad = None
        tensors[m] = tensor_peak_bytes(fn, device)
    return peaks, tensors


def format_dp_table(name: str, rows: list[dict], batch: int) -> str:
    """The rows as a fixed-width table, with a title line."""

    def fmt(v, spec, unit=""):
        return "-" if v is None else f"{v:{spec}}{unit}"

    lines = [f"## {name}, B={batch}, C={MAX_NORM}, sigma={SIGMA}",
             f"{'method':24} {'median':>10} {'IQR':>6} {'vs fwd+bwd':>10} {'tensors MB':>10} {'vs plain':>8} "
             f"{'RSS MB':>7} {'vs plain':>8} {'max |diff|':>10}  note"]
    for r in rows:
        ms = None if r["median_s"] is None else r["median_s"] * 1e3
        mb = None if r["peak"] is None else r["peak"] / 2**20
        tb = None if r.get("tensors") is None else r["tensors"] / 2**20
        iqr = None if r["iqr"] is None else 100 * r["iqr"]
        lines.append(f"{r['method']:24} {fmt(ms, '.1f', ' ms'):>10} {fmt(iqr, '.0f', '%'):>6} "
                     f"{fmt(r['vs_plain'], '.2f', 'x'):>10} {fmt(tb, '.2f'):>10} "
                     f"{fmt(r.get('tensors_vs_plain'), '.2f', 'x'):>8} {fmt(mb, '.1f'):>7} "
                     f"{fmt(r['peak_vs_plain'], '.2f', 'x'):>8} {fmt(r['max_diff'], '.1e'):>10}  {r['note']}")
    opacus = next((r for r in rows if r["method"] == "opacus ghost clipping" and r["median_s"]), None)
    if opacus is not None:
        differs = opacus["max_diff"] is not None and opacus["max_diff"] > DIFFERS
        lines.append(f"# opacus ghost clipping / pv clipped_grad_sum: {opacus['vs_pv']:.2f}x (each round's ratio"
                     + (f"; Opacus' sum is {opacus['max_diff']:.1e} off the loop's: not the same result)" if differs
                        else ")"))
    return "\n".join(lines)


def report(models: tuple[str, ...] = DP_MODELS, *, batch: int = 32, rounds: int = 9, device: str = "cpu",
           emit: Callable[[str], None] = print) -> None:
    """Print one table per model (those whose libraries are missing get a line saying so)."""
    emit(f"# DP-SGD gradient of one batch: {torch.get_num_threads()} threads, torch {torch.__version__}, {device}; "
         "times are medians of interleaved rounds (a shared machine: noisy)")
    for name in models:
        try:
            rows = dp_table(name, batch=batch, rounds=rounds, device=device)
        except ImportError as e:
            emit(f"## {name}: skipped ({e})")
            continue
        emit(format_dp_table(name, rows, batch))
