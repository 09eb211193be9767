"""The explorer's pure computations on what one setting computed: the loop (the definition, written out), the
verdict of a result against it, the norms and the DP-SGD view, the notes a learner must read. Tensors and records
in, records out; no timing, no state, no ipywidgets. (The chosen sample's panel is :mod:`.sample`.)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pergrad_viz.bench.records import FAILED, Record
from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.core.memory import check_held, result_bytes
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.core.validate import check_modes
from pergrad_viz.errors import human_bytes
from pergrad_viz.explorer.specs import ModelSpec
from pergrad_viz.explorer.state import (
    QUANTITIES,
    QUANTITY_NAMES,
    REFERENCES,
    ClipView,
    Computed,
    Setting,
    Verdict,
    View,
)
from pergrad_viz.strategies import STRATEGIES
from pergrad_viz.strategies.hooks import describe as describe_layers

__all__ = ["check", "checked_samples", "clipping", "how", "judge", "largest", "loop_rows", "noisy", "norms", "notes",
           "scaling_batches", "verdict", "with_records"]


def check(setting: Setting, spec: ModelSpec, outputs: int, dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a setting that is malformed or would not fit in memory (``outputs``: Y, 1 for gradients), before
    allocating anything; each error names the fix."""
    if setting.quantity not in QUANTITIES:
        raise ValueError(f"quantity must be one of {QUANTITIES}, got {setting.quantity!r}")
    if setting.batch < 1 or (setting.hidden < 1 and spec.width_name):
        raise ValueError(f"batch size and width must be positive, got {setting.batch}, {setting.hidden}")
    if spec.max_batch is not None and setting.batch > spec.max_batch:
        raise ValueError(f"batch size {setting.batch} is more than the {spec.max_batch} samples of the data")
    unknown = [s for s in setting.strategies if s != "auto" and s not in STRATEGIES]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; valid: 'auto', {', '.join(STRATEGIES)}")
    if not (setting.clip > 0 and math.isfinite(setting.clip)):
        raise ValueError(f"the clipping threshold must be a positive number, got {setting.clip!r}")
    if setting.slow_limit is not None and setting.slow_limit < 0:
        raise ValueError(f"slow_limit must be a number of sample-backward passes >= 0, got {setting.slow_limit}")
    p = spec.num_params(setting.hidden)
    grads = result_bytes(setting.batch, p, dtype)
    one = result_bytes(setting.batch, p, dtype, outputs)
    # the heatmap's (B, P) gradients, plus while timing: the reference result, a fresh one, a working copy
    check_held(what=f"the explorer at {setting.describe()} ({QUANTITY_NAMES[setting.quantity]})", held=grads + 3 * one,
               detail=f"the {human_bytes(grads)} gradients of the heatmap and three copies of the "
                      f"{human_bytes(one)} result while timing",
               fix="Choose a smaller batch size or width, or the per-sample gradients instead of the Jacobian.",
               device=device)


def scaling_batches(batch: int, options: Sequence[int], most: int) -> list[int]:
    """The batch sizes of the scaling curve: up to ``most`` of the ``options`` up to ``batch``, evenly spread on a
    log scale, always ending with ``batch``."""
    options = sorted(b for b in options if b <= batch) or [batch]
    n = min(most, len(options))
    if n <= 1:
        return [batch]
    picks = {options[round(k * (len(options) - 1) / (n - 1))] for k in range(n)}
    return sorted(picks | {batch})


def checked_samples(setting: Setting, most: int) -> torch.Tensor:
    """(n,) the samples compared with the loop: all of them up to ``most``, else ``most`` evenly spread over the
    batch (the first and the last included)."""
    if setting.batch <= most:
        return torch.arange(setting.batch)
    return torch.linspace(0, setting.batch - 1, most).round().long().unique()


def which(n: int, batch: int) -> str:
    return f"all {n} samples" if n == batch else f"{n} of {batch} samples, spread evenly over the batch,"


def verdict(setting: Setting, data: Computed, checked: torch.Tensor, dtype: torch.dtype) -> Verdict:
    """The heatmap's per-sample gradients (``hooks``) against the loop on the ``checked`` samples; the loop's
    result for the setting's quantity is kept (``data.reference``) as the reference of every method timed next."""
    idx = data.checked = checked
    loop = loop_rows(data.model, data.loss_fn, data.x, data.y, idx, "grads")
    scale = largest(loop)
    if setting.quantity == "grads":
        data.reference, data.reference_scale = loop, scale
    else:
        data.reference = loop_rows(data.model, data.loss_fn, data.x, data.y, idx, "jacobian", data.output)
        data.reference_scale = largest(data.reference)
    diff = float(torch.linalg.vector_norm(data.grads[idx] - loop, ord=math.inf))
    return judge(setting, data, {"hooks": diff}, scale=scale, quantity="grads", dtype=dtype)


def largest(reference: torch.Tensor) -> float:
    """max |value| of the loop's result: the scale of the tolerance (computed once per result: a large one, e.g.
    (64, 407,050) at B=256 and hidden width 512, takes tens of milliseconds to read)."""
    return float(torch.linalg.vector_norm(reference, ord=math.inf))


def judge(setting: Setting, data: Computed, diffs: dict[str, float], *, scale: float, quantity: str,
          dtype: torch.dtype, before: Verdict | None = None) -> Verdict:
    """A verdict on ``diffs`` ({strategy: max |difference| from the loop}), together with ``before``'s; ``scale``:
    the loop's max |value| (:func:`largest`), the tolerance being 1e-4 of it (at least 1e-4)."""
    tolerance = 1e-4 * max(1.0, scale)
    failed = [m for m, d in diffs.items() if not d <= tolerance]  # NaN fails
    checked = list(diffs)
    worst = max(diffs.values(), default=0.0)
    if before is not None:
        checked = [*before.checked, *(m for m in checked if m not in before.checked)]
        failed = [*before.failed, *(m for m in failed if m not in before.failed)]
        worst = max(worst, before.max_abs_diff) if math.isfinite(worst) else worst
    n = int(data.checked.numel())
    dtype_name = str(dtype).removeprefix("torch.")
    what = QUANTITY_NAMES[quantity]
    where = f"{what} at {setting.describe()}"
    details = (f"max |difference| {worst:.1e} ({dtype_name}; {which(n, setting.batch)} checked against the "
               f"loop; tolerance {tolerance:.0e})")
    if failed:
        text = f"{', '.join(failed)} DISAGREE with the loop (the definition) on the {where}: {details}"
    elif len(checked) == 1:
        text = f"{checked[0]} agrees with the loop (the definition) on the {where}: {details}"
    else:
        text = f"{', '.join(checked)} agree with the loop (the definition) on the {where}: {details}"
    return Verdict(not failed, worst, tolerance, n, setting.batch, text, tuple(checked), tuple(failed))


def with_records(view: View, data: Computed, records: Sequence[Record], pending: tuple[str, ...], reused: int,
                 provisional: tuple[str, ...], stage: str, dtype: torch.dtype) -> View:
    """``view`` with the records timed so far, its verdict extended by their differences from the loop."""
    verdict_ = view.verdict
    order = {name: k for k, name in enumerate(view.setting.strategies)}
    diffs = {r.strategy: r.max_abs_diff for r in sorted(records, key=lambda r: order.get(r.strategy, len(order)))
             if r.max_abs_diff is not None and r.strategy not in REFERENCES}
    if verdict_ is not None and diffs and data.reference is not None:
        quantity = view.setting.quantity
        if data.reference_scale is None:
            data.reference_scale = largest(data.reference)
        verdict_ = judge(view.setting, data, diffs, scale=data.reference_scale, quantity=quantity, dtype=dtype,
                         before=data.verdict if quantity == "grads" else None)
        if quantity != "grads" and not data.verdict.ok:  # the heatmap's gradients disagree: say so first
            verdict_ = dataclasses.replace(verdict_, ok=False, text=f"{data.verdict.text}; {verdict_.text}")
    return dataclasses.replace(view, stage=stage, records=tuple(records), pending=pending, reused=reused,
                               verdict=verdict_, provisional=provisional, noisy=noisy(records),
                               notes=notes(view.setting, records, provisional))


def norms(grads: torch.Tensor, bounds: Sequence[tuple[str, int, int]]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(total (B,), {layer: (B,)}): each sample's gradient norm, in all and per layer (a layer's parameters
    together), from the (B, P) ``grads`` and the parameters' columns ``bounds``."""
    squares: dict[str, torch.Tensor] = {}  # {layer: (B,)} squared norms, weight and bias together
    for name, a, b in bounds:
        layer = name.rsplit(".", 1)[0]
        sq = torch.linalg.vector_norm(grads[:, a:b], dim=1).square()  # no (B, P) temporary
        squares[layer] = squares[layer] + sq if layer in squares else sq
    layers = {k: v.sqrt() for k, v in squares.items()}
    total = torch.stack(list(squares.values())).sum(0).sqrt()
    return total, layers


def clipping(setting: Setting, data: Computed) -> ClipView:
    """The DP-SGD view at ``setting.clip``: each sample's scale, how many are clipped, the sums' norms. The clipped
    sum is taken here from the (B, P) gradients the explorer holds to draw them; :func:`pergrad_viz.clipped_grad_sum`
    forms it without them (per layer, ``G^T diag(c) A`` from the captured output gradients G and inputs A)."""
    c = setting.clip
    factors = (c / data.total.clamp_min(1e-12)).clamp(max=1.0)  # (B,): DP-SGD's per-sample scale
    plain = data.grads.sum(dim=0)
    clipped_sum = factors @ data.grads  # (P,) without a (B, P) temporary
    clipped = int((data.total > c * (1 + 1e-5)).sum())
    return ClipView(c, data.total, data.layers, clipped, float(plain.norm()), float(clipped_sum.norm()))


def how(model: nn.Module, x: object) -> tuple[tuple[str, str, str], ...]:
    """(layer, module type, ``"rule"`` | ``"call"`` | ``"fallback"``) for each layer with trainable parameters."""
    modules = dict(model.named_modules())
    kinds = describe_layers(Trainable.of(model), Batch.of(x))
    return tuple((name, type(modules[name]).__name__ if name in modules else "-", kind) for name, kind in kinds.items())


def output_count(spec: ModelSpec, width: int) -> int:
    """Y, the outputs of one sample of a user's network (``spec.output``'s tensor where given): one forward of one
    sample, its buffers left as they were (BatchNorm in training mode refused first, as every call refuses it)."""
    model, _, x, _, _ = spec.problem(1, width)
    check_modes(model)
    with restoring_modes(model), torch.no_grad():
        out = Batch.of(x)(model)
        out = out if spec.output is None else spec.output(out)
    return int(out.numel()) if isinstance(out, torch.Tensor) else 1


def loop_rows(model: nn.Module, loss_fn: Callable, x: object, y: object, idx: torch.Tensor,
              quantity: str, output: Callable[[object], torch.Tensor] | None = None) -> torch.Tensor:
    """The definition, written out (no strategy of the package involved): for each sample i of ``idx`` run alone,
    ``torch.autograd.grad`` of its loss (``"grads"``: (n, P)) or of each of its outputs (``"jacobian"``:
    (n, Y * P), the flat (Y, P) layout; ``output`` picks the tensor of the model's output), over the trainable
    parameters in ``named_parameters`` order."""
    params = [p for p in model.parameters() if p.requires_grad]
    batch = Batch.of(x)
    rows = []
    with torch.enable_grad():
        for i in idx.tolist():
            out = batch.sample(i)(model)
            if quantity == "grads":
                parts = [torch.autograd.grad(loss_fn(out, cut(y, slice(i, i + 1), batch.size)), params)]
            else:
                flat = (out if output is None else output(out)).reshape(-1)
                parts = [torch.autograd.grad(flat[j], params, retain_graph=True) for j in range(flat.numel())]
            rows.append(torch.cat([g.reshape(-1) for grads in parts for g in grads]))
    return torch.stack(rows)


def noisy(records: Sequence[Record]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(r.strategy for r in records if r.noisy))


def notes(setting: Setting, records: Sequence[Record], provisional: Sequence[str] = ()) -> tuple[str, ...]:
    """The lines a learner must see: the strategies that failed (and why), the slow baselines skipped (and why, and how
    to time them), the numbers still being measured (provisional: not a warning), the noisy measurements."""
    lines = []
    if not setting.strategies:
        lines.append("skipped: no strategy is ticked, so only the references are timed; tick one to compare (the "
                     "heatmap and the verdict are of the per-sample gradients hooks computes, whatever is ticked).")
    failed = [r for r in records if r.skipped and r.note.startswith(FAILED)]
    for r in failed:
        lines.append(f"failed: {r.strategy} could not run at {setting.describe()}, so it is not timed "
                     f"({r.note.removeprefix(FAILED)}); the other rows are. auto hands such a model over to a "
                     "strategy that runs it.")
    skipped = [r for r in records if r.skipped and r not in failed]
    if skipped:
        reason = skipped[0].note.removeprefix("skipped: ")
        names = ", ".join(r.strategy for r in skipped)
        lines.append(f"skipped as too slow at {setting.describe()}: {names} ({reason} for "
                     f"{skipped[0].strategy}). Lower the batch size, or raise 'time slow methods up to' (above the "
                     "table) to time them.")
    if provisional:
        lines.append(f"provisional: the first rounds of {', '.join(provisional)} varied, so more rounds are being "
                     "timed; the numbers may still move.")
    noisy_ = noisy(records)
    if noisy_:
        lines.append(f"noisy measurement: the rounds of {', '.join(noisy_)} still varied after the extra rounds "
                     "(other programs are using the CPU), so these times are uncertain and not kept: press 'rerun "
                     "timings' or come back to this setting later.")
    return tuple(lines)
