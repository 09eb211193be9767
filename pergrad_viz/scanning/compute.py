"""What a scan computes for one batch: per-sample losses, gradient norms (total and per layer), EL2N scores
and gradient sketches, from as few passes as the model allows.

Shapes: B samples in the batch, C classes, L layers (blocks, see :mod:`pergrad_viz.scanning.sketch`), K = proj_dim.

* **losses / EL2N only**: one forward pass under ``torch.no_grad()``.
* **anything with gradients, on models the hooks strategy covers**: one forward pass with hooks and one
  backward pass of the summed per-sample losses to the layer outputs (:mod:`pergrad_viz.engine.capture`),
  shared by every quantity. Norms come from the same per-layer pieces as :func:`pergrad_viz.per_sample_grad_norms`
  (for a Linear layer the ghost norm ||g_i|| ||a_i||; other layers their own (B, *param.shape) gradient);
  sketches of Linear layers come from the layer input and output gradient (never the (B, out, in) gradient),
  other layers' sketches from their own per-layer gradient. The whole (B, P) is never formed.
* **otherwise** (models hooks cannot take, tied weights, data-dependent layer calls): the loss from a
  no-grad forward, norms from :func:`pergrad_viz.per_sample_grad_norms`, and, with a sketch, the
  per-sample gradients of the batch from :func:`pergrad_viz.per_sample_grads` (B x P for this batch only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pergrad_viz import api
from pergrad_viz.core.batch import Batch
from pergrad_viz.core.guards import check_reached, refusing_reentrant_checkpoints
from pergrad_viz.core.loss_reads import loss_reads_parameters
from pergrad_viz.core.losses import LossFn, logits_of, per_sample_losses
from pergrad_viz.core.numbers import SQUARES, wide_square
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.derived.checked_pass import CheckedPass
from pergrad_viz.derived.norms import (
    ghost_kind,
    layer_squared_norms,
    per_sample_grad_norms,
    row_squared_norms,
    stack_calls,
)
from pergrad_viz.engine.backward import backward_to_layers
from pergrad_viz.engine.capture import capture
from pergrad_viz.engine.certify import check_norms
from pergrad_viz.engine.combination import check_combination
from pergrad_viz.engine.grouping import dense_grads, group_calls, tied_names
from pergrad_viz.engine.probe import plan_for
from pergrad_viz.errors import HandOverError, UnsupportedModelError
from pergrad_viz.scanning.sketch import Block, GradientSketch

GRAD_QUANTITIES = frozenset({"grad_norm", "layer_norms", "projection"})


class _NeedsMaterialising(HandOverError):
    """Tied parameters (their per-layer shares must be summed before a norm), a loss that reads a parameter itself:
    what the materialised path does."""


class SelectedLoss:
    """``loss_fn(select(output), targets)``: a scan's loss on the tensor ``output=`` picks from what the model returns
    (``lambda out: out.logits`` for a Hugging Face ``ModelOutput``); the scan hands ``select(output)`` to
    ``loss_fn`` itself where it has the output, keeping the ``torch.nn`` losses' one-call path."""

    def __init__(self, loss_fn: LossFn, select: Callable[[object], torch.Tensor]):
        self.loss_fn, self.select = loss_fn, select

    def __call__(self, output: object, targets: object) -> torch.Tensor:
        return self.loss_fn(self.select(output), targets)


def _split(loss_fn: LossFn) -> tuple[LossFn, Callable[[object], object]]:
    """(the loss, the selector) of a scan's loss: the selector is the identity without ``output=``."""
    if isinstance(loss_fn, SelectedLoss):
        return loss_fn.loss_fn, loss_fn.select
    return loss_fn, lambda out: out


def _losses(loss_fn: LossFn, output: object, y: object) -> tuple[object, torch.Tensor]:
    """(the selected output, per-sample losses (B,)); a ``torch.nn`` loss handed a model output that is not a tensor
    is refused naming ``output=``."""
    loss, select = _split(loss_fn)
    output = select(output)
    if isinstance(loss, nn.modules.loss._Loss) and not isinstance(output, torch.Tensor):
        raise TypeError(
            f"the model returns a {type(output).__name__}, not a tensor, and {type(loss).__name__} takes a tensor: "
            "say which tensor the loss is of with pv.scan(..., output=lambda out: out.logits) (or out[0]), or use a "
            "loss that takes the model output (pergrad_viz.core.losses.sequence_classification_loss / causal_lm_loss)")
    return output, per_sample_losses(loss, output, y)


def _batch_losses(trainable: Trainable, inputs: Batch, loss_fn: LossFn, y: torch.Tensor) -> tuple[object, torch.Tensor]:
    """(the outputs, the (B,) losses) of the batch: from one forward where the samples are apart, else (the probe
    found them interact: a batch statistic) each example's alone, as its loss is defined."""
    loss, select = _split(loss_fn)
    probed = trainable if loss is loss_fn else trainable.selecting(select)  # output= mixing the samples: seen
    if not (trainable.params and _interacting(probed, inputs)):
        with torch.no_grad():
            return _losses(loss_fn, inputs(trainable.model), y)
    outputs, losses = [], []
    with torch.no_grad():
        for i in range(inputs.size):
            output, loss = _losses(loss_fn, inputs.sample(i)(trainable.model), y[i:i + 1])
            outputs.append(logits_of(output) if not isinstance(output, torch.Tensor) else output)
            losses.append(loss)
    return torch.cat(outputs), torch.cat(losses)


def _interacting(trainable: Trainable, inputs: Batch) -> bool:
    """Whether the probe's plan (cached per model state and input signature) found the samples interact; a model the
    probe cannot run (a strategy's refusal) counts as keeping them apart, as before."""
    try:
        return plan_for(trainable, inputs).interaction is not None
    except UnsupportedModelError:
        return False


def el2n(output: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """EL2N scores (B,): ||softmax(logits_i) - onehot(y_i)||_2 for logits (B, C) and class indices y (B,) (or a model
    output holding the logits: a Hugging Face ``ModelOutput``, see :func:`pergrad_viz.core.losses.logits_of`)."""
    output = logits_of(output)
    if output.dim() != 2 or y.dim() != 1 or y.is_floating_point() or y.shape[0] != output.shape[0]:
        raise ValueError(
            f"el2n needs class logits (B, C) and class-index labels (B,), got output {tuple(output.shape)} and labels "
            f"{tuple(y.shape)} {y.dtype}: drop 'el2n' from quantities for models that are not classifiers"
        )
    p = torch.softmax(output.detach(), dim=1)
    p[torch.arange(y.shape[0], device=y.device), y] -= 1
    return torch.linalg.vector_norm(p, dim=1)


def _outputs(want: set[str], output: torch.Tensor, losses: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    res = {}
    if "loss" in want:
        res["loss"] = losses.detach()
    if "el2n" in want:
        res["el2n"] = el2n(output, y)
    return res


def _from_squared(want: set[str], squared: dict[str, torch.Tensor], blocks: list[Block],
                  dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """grad_norm (B,) and layer_norms (B, L) in ``dtype`` from {name: (B,) squared norms} (float64 squares)."""
    res = {}
    per_block = torch.stack([sum(squared[n].to(SQUARES) for n in b.params) for b in blocks], dim=1)  # (B, L)
    if "grad_norm" in want:
        res["grad_norm"] = per_block.sum(1).sqrt().to(dtype)
    if "layer_norms" in want:
        res["layer_norms"] = per_block.sqrt().to(dtype)
    return res


def batch_quantities(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, want: set[str],
                     blocks: list[Block], sketch: GradientSketch | None, use_hooks: bool) -> dict[str, torch.Tensor]:
    """{quantity: (B, ...)} for one batch: ``loss`` (B,), ``grad_norm`` (B,), ``layer_norms`` (B, L),
    ``el2n`` (B,), ``projection`` (B, K), as asked in ``want``."""
    trainable, inputs = Trainable.of(model), Batch.of(x, size=len(y))
    if not want & GRAD_QUANTITIES:
        output, losses = _batch_losses(trainable, inputs, loss_fn, y)
        return _outputs(want, output, losses, y)

    def run(used: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor] | None]:
        if used == "hooks":
            return _hooks_batch(trainable, inputs, loss_fn, y, want, blocks, sketch)
        return _materialised_batch(model, loss_fn, x, y, want, blocks, sketch), None

    def check(result: tuple, used: str) -> None:
        if used == "hooks":  # materialised gradients were checked as they were computed
            check_combination(trainable, loss_fn, inputs, y, used, result[1])  # every row at once, and alone
            check_norms(trainable, loss_fn, inputs, y, result[1], used)  # one sample alone

    # The one hand-over (api.hand_over): the hooked pass, then materialised gradients where it cannot be trusted.
    res, _ = api.hand_over("auto", "hooks" if use_hooks else "torch_func", trainable, inputs, run, check, "scan", y,
                           may_race=False)
    return res


def _hooks_batch(trainable: Trainable, inputs: Batch, loss_fn: LossFn, y: torch.Tensor, want: set[str],
                 blocks: list[Block], sketch: GradientSketch | None
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The batch's quantities from one hooked forward and backward, and the squared norms {name: (B,)} (for the
    check)."""
    batch = len(y)
    with restoring_modes(trainable), refusing_reentrant_checkpoints():
        output, calls = capture(trainable, inputs)
        check_reached(trainable, calls)
        if tied_names(calls):
            raise _NeedsMaterialising("tied parameters: the scan materialises their gradients")
        output, losses = _losses(loss_fn, output, y)  # (B,)
        total = losses.sum()
        if loss_reads_parameters(_split(loss_fn)[0], total, output, trainable.params):
            raise _NeedsMaterialising("the loss reads a trainable parameter itself: the scan materialises the batch's "
                                      "gradients (each sample's loss run with the parameters)")
        per_call = backward_to_layers(trainable, calls, total)
    checked = CheckedPass(trainable, batch)  # what a checked call forms too (derived/checked_pass.py)
    checked.begin()
    res = _outputs(want, output, losses, y)
    kw = {"dtype": trainable.dtype, "device": trainable.device}
    squared = {n: torch.zeros(batch, dtype=SQUARES, device=trainable.device) for n in trainable.names}
    dense: dict[str, torch.Tensor] = {}  # full name -> (B, *shape), only where a sketch needs it
    sketched: dict[int, torch.Tensor] = {}  # block index -> (B, k_b)
    want_sketch = sketch is not None and "projection" in want
    names = {id(m): n for n, m in trainable.modules}
    for layer, seen in group_calls(calls, per_call).values():
        checked.layer(layer, seen, slice(None))
        local = layer.local
        kind = ghost_kind(layer)
        index = sketch.by_module.get(names[id(layer.module)]) if want_sketch else None
        linear_sketch = (index is not None and kind == "linear" and sketch.blocks[index].kind == "kronecker"
                         and set(sketch.blocks[index].block.params) == set(local.values()))
        if kind is not None:
            for ln, sq in layer_squared_norms(layer, seen).items():
                squared[local[ln]] = sq
        if linear_sketch:
            a, g = stack_calls(layer, seen)  # (B, T, in), (1, B, T, out)
            sketched[index] = sketch.project_linear(index, a, g[0])
        elif kind is None or want_sketch:
            for ln, t in dense_grads(layer, seen).items():  # (1, B, *shape)
                dense[local[ln]] = t[0]
                if kind is None:
                    squared[local[ln]] = row_squared_norms(t[0])
    checked.keep()
    res.update(_from_squared(want, squared, blocks, trainable.dtype))
    if want_sketch:
        for i, bs in enumerate(sketch.blocks):
            if i not in sketched:
                missing = [n for n in bs.block.params if n not in dense]  # parameters the forward never used
                for n, shape in zip(bs.block.params, bs.block.shapes, strict=True):
                    if n in missing:
                        dense[n] = torch.zeros(batch, *shape, **kw)
                sketched[i] = sketch.project_block(i, dense)
        res["projection"] = torch.cat([sketched[i] for i in range(len(sketch.blocks))], dim=1)
    return res, squared


def _materialised_batch(model: nn.Module, loss_fn: LossFn, x: torch.Tensor, y: torch.Tensor, want: set[str],
                        blocks: list[Block], sketch: GradientSketch | None) -> dict[str, torch.Tensor]:
    res: dict[str, torch.Tensor] = {}
    # also where neither is wanted: a loss that cannot take the output is refused clearly
    output, losses = _batch_losses(Trainable.of(model), Batch.of(x, size=len(y)), loss_fn, y)
    res.update(_outputs(want, output, losses, y))
    if sketch is not None and "projection" in want:
        grads = api.per_sample_grads(model, loss_fn, x, y)  # {name: (B, *shape)}: this batch only
        squared = {n: row_squared_norms(g) for n, g in grads.items()}
        res["projection"] = sketch.project_grads(grads)
        dtype = next(iter(grads.values())).dtype
    else:
        norms = per_sample_grad_norms(model, loss_fn, x, y, per_parameter=True)
        squared = {n: wide_square(t) for n, t in norms.items()}
        dtype = next(iter(norms.values())).dtype
    res.update(_from_squared(want, squared, blocks, dtype))
    return res
