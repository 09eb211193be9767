"""The per-call check: one randomly chosen sample, computed alone by the definition, against its row of a result.

A strategy that runs the model once on the whole batch (``hooks``, ``autograd_stack``, ``batched_grad``) relies on
what the probe measured (``engine.probe``): that the samples do not interact and where each layer holds them.
No probe of a few samples can prove that for every batch: rows reordered inside ``forward`` in a way a pair does not
show, a coupling through a batch statistic that only some inputs trigger, code that depends on the batch size, a
coupling only in a custom backward, a plan gone stale after the model changed. So every such call ends with this
check: sample i, drawn uniformly from the batch with a private random generator (the caller's RNG is untouched), runs
alone (``loss_fn(model(inputs[i:i+1]), targets[i:i+1])``, one small forward and backward) and its gradient is
compared with row i of the result; for a Jacobian, a random combination ``u^T J_i`` of its rows (one backward).

What it catches: any wrong row it draws, so a fault that touches a fraction f of the rows with probability f per
call (1 for faults that touch every row: batch-size dependent code, a stale plan, a coupling through the batch; at
least 1/B for a single misplaced row), and with probability 1 - (1 - f)^k over k calls. Differences below the
tolerance (relative 1e-6 in float64, 1e-3 in float32, per parameter tensor) pass.
"""

from __future__ import annotations

import math
import os
import random
from collections import Counter
from collections.abc import Mapping

import torch

from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.core.losses import LossFn, scalar_loss
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.errors import UnsupportedModelError

_DRAW = random.Random(int.from_bytes(os.urandom(8), "little"))  # private: the caller's random state is not touched


class CheckFailedError(UnsupportedModelError):
    """A batched strategy's row differs from that sample computed alone (see the module docstring)."""


def _tolerance(dtype: torch.dtype) -> float:
    if dtype == torch.float64:
        return 1e-6
    if dtype in (torch.float16, torch.bfloat16):
        return 5e-2
    return 1e-3


def draw(batch: int) -> int:
    """A sample index in [0, batch), uniformly, from the check's own generator."""
    return _DRAW.randrange(batch)


def _compare(trainable: Trainable, want: tuple[torch.Tensor | None, ...], got: Mapping[str, torch.Tensor],
             sample: int, strategy: str, what: str) -> None:
    """Per parameter tensor: |got - want| <= rtol * max(|want|, 1e-3 |want of all parameters|) (2-norms).

    All norms in one ``_foreach_norm`` and read with one ``tolist``: a few kernel launches and one host read whatever
    the number of parameters (per-tensor ``float()`` reads cost half the check on small models). In the result's own
    precision (float32 at least): a norm's rounding (about 1e-4 of it over a million float32 values) moves a
    threshold of 1e-3 relative by a tenth of its size at most; only where a float32 norm overflows are they taken
    again in float64 (casting every gradient to float64 cost a sixth of the check on a ViT). The differences are
    taken in the result's dtype: a rounded subtraction is within one ulp of the exact difference, far below every
    tolerance, and one that overflows is a real failure (and reads as one). The scale is |want| alone, not
    max(|want|, |got|): since |got| <= |want| + |got - want|, the two differ only where the difference is within a
    factor 1 + rtol of the tolerance, and there this one is the stricter; it saves a third of the reads."""
    rtol = _tolerance(trainable.dtype)
    wants = _dense(want, trainable)
    n = len(wants)
    norms = _norms(wants, trainable.dtype)
    # want - got written over want (fresh gradients of this check): a second set of parameter-sized temporaries
    # would cost its page faults on every call (20 ms of 46 on ResNet-18). Not over an expanded gradient, nor over one
    # whose memory another parameter's gradient shares (autograd hands the same tensor to two biases (1, D) added to
    # the same output).
    storages = Counter(w.untyped_storage().data_ptr() for w in wants)
    diffs = [w.sub_(got[name]) if w.is_contiguous() and storages[w.untyped_storage().data_ptr()] == 1
             else w - got[name] for w, name in zip(wants, trainable.names, strict=True)]
    norms += _norms(diffs, trainable.dtype)
    total = sum(w * w for w in norms[:n]) ** 0.5
    for k, name in enumerate(trainable.names):
        w, diff = norms[k], norms[n + k]
        size = max(w, 1e-3 * total)
        if (diff > rtol * size and diff > 0) or (not math.isfinite(diff) and math.isfinite(w)):
            raise CheckFailedError(
                f"the per-call check found that sample {sample}'s {what} from the {strategy} strategy differs from "
                f"sample {sample} computed alone (parameter '{name}': relative difference "
                f"{diff / max(size, 1e-300):.1e}): this model's forward does not keep the samples apart in a way "
                "the probe of a few samples could see "
                "(rows reordered inside forward, a batch statistic, code that depends on the batch size, a coupling "
                "in a custom backward, or a model changed since its plan was made). Use strategy='auto' (which then "
                "computes each sample alone) or 'torch_func' / 'loop'."
            )


def _dense(grads: tuple[torch.Tensor | None, ...], trainable: Trainable) -> list[torch.Tensor]:
    """One gradient per parameter, each a dense tensor: zeros where a parameter was not used, dense where it is sparse
    (``nn.Embedding(sparse=True)``)."""
    return [torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g
            for g, p in zip(grads, trainable.params, strict=True)]


def _norms(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[float]:
    """The 2-norms of ``tensors`` as floats: one ``_foreach_norm``, one host read; in ``dtype`` (float32 at least),
    again in float64 where one is not finite (an overflowed float32 sum of squares, or a real inf / nan)."""
    low = dtype in (torch.float16, torch.bfloat16)
    norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32 if low else None)).tolist()
    if not all(map(math.isfinite, norms)):
        norms = torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float64)).tolist()
    return norms


def _grad(output: torch.Tensor, params: tuple, **kw: object) -> tuple:
    """``autograd.grad`` with ``allow_unused``; None for every parameter where no trainable parameter reaches
    ``output`` (a sample alone the forward sends past them: zeros, as in the loop)."""
    if not output.requires_grad:
        return (None,) * len(params)
    return torch.autograd.grad(output, params, allow_unused=True, **kw)


def _loss_alone(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object, i: int) -> torch.Tensor:
    """The definition: sample i's loss with the model run on sample i alone."""
    return scalar_loss(loss_fn(inputs.sample(i)(trainable.model), cut(targets, slice(i, i + 1), inputs.size)))


def check_grads(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
                rows: Mapping[str, torch.Tensor], strategy: str) -> None:
    """Raise :class:`CheckFailedError` unless row i of ``rows`` {name: (B, *param.shape)} is sample i's gradient."""
    i = draw(inputs.size)
    loss = _loss_alone(trainable, loss_fn, inputs, targets, i)
    want = _grad(loss, trainable.params)
    _compare(trainable, want, {n: t[i] for n, t in rows.items()}, i, strategy, "gradient")


def check_jacobian(trainable: Trainable, inputs: Batch, rows: Mapping[str, torch.Tensor],
                   strategy: str, flat: torch.Tensor | None = None) -> None:
    """Raise :class:`CheckFailedError` unless ``u^T`` row i of ``rows`` {name: (B, Y, *param.shape)} is ``u^T J_i``
    for a random u (Y,). ``flat``: the (B, Y, P) tensor ``rows`` are views of, if any (then ``u^T`` row i is one
    matrix-vector product instead of one per parameter)."""
    i = draw(inputs.size)
    output = trainable.outputs(inputs.sample(i)).reshape(-1)
    gen = torch.Generator(device=output.device).manual_seed(_DRAW.getrandbits(62))
    u = torch.randn(output.numel(), generator=gen, dtype=output.dtype, device=output.device)
    want = _grad(output @ u, trainable.params)
    if flat is not None:
        combined = (u @ flat[i]).split([p.numel() for p in trainable.params])  # (P,), cut per parameter
        got = {n: c.view(p.shape) for n, c, p in zip(trainable.names, combined, trainable.params, strict=True)}
    else:
        got = {n: torch.tensordot(u, t[i], dims=1) for n, t in rows.items()}
    _compare(trainable, want, got, i, strategy, "Jacobian (a random combination of its rows)")


def check_norms(trainable: Trainable, loss_fn: LossFn, inputs: Batch, targets: object,
                squared: Mapping[str, torch.Tensor], strategy: str) -> None:
    """Raise :class:`CheckFailedError` unless entry i of ``squared`` {name: (B,)} is the squared norm of sample i's
    gradient, per parameter."""
    i = draw(inputs.size)
    loss = _loss_alone(trainable, loss_fn, inputs, targets, i)
    grads = _dense(_grad(loss, trainable.params), trainable)
    wants = _norms(grads, trainable.dtype)
    gots = torch.stack([squared[name][i] for name in trainable.names]).double().sqrt().tolist()
    rtol = _tolerance(trainable.dtype)
    total = sum(w * w for w in wants) ** 0.5
    for name, w, got in zip(trainable.names, wants, gots, strict=True):
        diff = abs(got - w)
        if (diff > rtol * max(got, w, 1e-3 * total) and diff > 0) or (not math.isfinite(diff) and math.isfinite(w)):
            raise CheckFailedError(
                f"the per-call check found that sample {i}'s gradient norm from the {strategy} strategy differs from "
                f"sample {i} computed alone (parameter '{name}': {got:.6g} instead of {w:.6g}): this model's "
                "forward does not keep the samples apart in a way the probe of a few samples could see. Use "
                "strategy='auto' (which then computes each sample alone) or 'torch_func' / 'loop'."
            )


def _jacobian_alone(trainable: Trainable, x: Batch) -> torch.Tensor:
    """(Y, P): one sample's Jacobian by the definition, one backward per output."""
    output = trainable.outputs(x).reshape(-1)
    rows = []
    for j in range(output.numel()):
        grads = _grad(output[j], trainable.params, retain_graph=True)
        rows.append(torch.cat([(torch.zeros_like(p) if g is None else g.to_dense() if g.is_sparse else g).reshape(-1)
                               for g, p in zip(grads, trainable.params, strict=True)]))
    return torch.stack(rows)


def check_ntk(trainable: Trainable, x1: Batch, x2: Batch | None, kernel: torch.Tensor,
              full: bool) -> None:
    """Raise :class:`CheckFailedError` unless the block K[i, j] of ``kernel`` ((N1, N2, Y, Y) if ``full``, else
    (N1, N2)) for one random pair equals ``J_i J_j^T`` (or its trace) from the two samples computed alone."""
    i = draw(x1.size)
    other = x1 if x2 is None else x2
    j = draw(other.size)
    j1, j2 = _jacobian_alone(trainable, x1.sample(i)), _jacobian_alone(trainable, other.sample(j))
    want = j1 @ j2.T if full else (j1 * j2).sum()
    got = kernel[i, j]
    diff = float((got.double() - want.double()).norm())
    scale = float(j1.double().norm() * j2.double().norm())
    if (diff > _tolerance(trainable.dtype) * max(scale, 1e-300) and diff > 0) or not math.isfinite(diff):
        raise CheckFailedError(
            f"the per-call check found that the kernel entry K[{i}, {j}] differs from J_{i} J_{j}^T computed from the "
            f"two samples alone (difference {diff:.2e} against a scale of {scale:.2e}): the model's forward does not "
            "keep the samples apart in a way the probe could see."
        )
