"""Per-sample gradient clipping and the DP-SGD gradient, on the results of :func:`pergrad_viz.per_sample_grads`.

Shapes: B samples, P trainable scalars. Gradients come either flat, (B, P), or as a dict
``{name: (B, *param.shape)}``; each sample is clipped over all of its parameters jointly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from pergrad_viz.core.layout import sample_rows
from pergrad_viz.core.numbers import real_number, wide_square
from pergrad_viz.rules.scaling import row_norms

Grads = torch.Tensor | dict[str, torch.Tensor]

EPS = 1e-6  # added to the norm in the scale factor, as Opacus does


# Clipping groups: (bound C_k, the parameter names clipped together), in order.
Groups = Sequence[tuple[float, tuple[str, ...]]]
PerLayer = bool | Mapping[str, float]  # per_layer=: one bound, one per parameter, or bounds by module prefix

def check_finite(squared: torch.Tensor, first: int = 0) -> float:
    """ValueError naming the samples whose gradient is not finite, from their squared norms ``squared`` (B,) or (K,
    B) (float64: a finite float32 gradient's square is finite; ``first``: the batch row of column 0). One such sample
    would make the whole clipped sum NaN (its clip factor is 0 or NaN, and 0 * inf is NaN), and the loop's sum of
    the definition is NaN too: refused, naming the rows, before anything is summed. One host read of one sum, which it
    returns (every squared norm is at most it: :func:`clip_factors`' bound on the smallest clip factor)."""
    total = squared.sum().item()
    if math.isfinite(total):
        return total
    bad = ~torch.isfinite(squared if squared.dim() == 1 else squared.sum(0))
    rows = [first + i for i in bad.nonzero().flatten().tolist()]
    raise ValueError(
        f"sample(s) {rows[:8]}{' ...' if len(rows) > 8 else ''} of this batch have a gradient that is not finite (inf "
        "or NaN: an input or target holding inf / NaN, a loss that overflows, or a forward that makes a NaN, as some "
        "attention does on a left-padded sample), so their clip factor is undefined "
        "and the clipped sum would be NaN in every entry. Drop those samples (e.g. keep the rows where "
        "torch.isfinite(x).flatten(1).all(1)), or find what overflows with pv.per_sample_grad_norms. A loss that is "
        "0 / 0 for one sample alone (reduction='mean' with a class weight of 0 for its label, or every target of "
        "it ignore_index) gives NaN too: use reduction='sum'. (A finite gradient whose norm is past 1.3e154 has a "
        "square beyond float64's range, where the norms are summed: scale the loss down.)"
    )


def clip_factors(squared: Mapping[str, torch.Tensor], groups: Groups, dtype: torch.dtype, total: float = math.inf
                 ) -> dict[str, torch.Tensor]:
    """{name: (B,) c} in ``dtype`` with c = min(1, C_k / (||g_i||_k + 1e-6)), the norm over the parameters of name's
    group k (from float64 squares: a float32 norm over 1.8e19 is c = C / norm, not 0). ``total``: at least every
    squared norm (:func:`check_finite`'s sum): where C_k / sqrt(total) is within ``dtype``'s normal range no factor
    can leave it, and nothing is read from the device."""
    factors = {}
    for bound, names in groups:
        norm = squared[names[0]].sqrt() if len(names) == 1 else torch.stack([squared[n] for n in names]).sum(0).sqrt_()
        c = norm.add_(EPS).reciprocal_().mul_(bound).clamp_(max=1.0)  # (B,), norm's own memory
        if dtype in _SUBNORMAL_FACTORS and bound / (math.sqrt(total) + EPS) < torch.finfo(dtype).tiny:
            _check_narrow_factors(c, bound, dtype)
        factors.update(dict.fromkeys(names, c.to(dtype)))
    return factors


_SUBNORMAL_FACTORS = (torch.float16, torch.bfloat16, torch.float32)  # float64's factors are computed in float64


def _check_narrow_factors(c: torch.Tensor, bound: float, dtype: torch.dtype) -> None:
    """ValueError where a clip factor (B,) would be a subnormal number of ``dtype``, rounded by up to 100% (a clipped
    gradient of norm up to 2 C: the DP bound broken; float16 below 6e-5, float32 and bfloat16 below 1.2e-38). One
    host read, only where :func:`clip_factors` could not rule it out."""
    tiny = torch.finfo(dtype).tiny
    least = c.min().item()  # 0 where even float64 underflowed (max_norm=1e-300 for norms of 1e30)
    if least >= tiny:
        return
    rows = (c < tiny).nonzero().flatten().tolist()
    name = str(dtype).removeprefix("torch.")
    norm = f"{bound / least:.3g}" if least > 0 else "over 1e308 times max_norm"
    fix = ("train in bfloat16 or float32 (model.to(torch.bfloat16)), or scale the loss down" if dtype == torch.float16
           else "scale the loss down (its gradients are past 1e38 times max_norm)")
    raise ValueError(
        f"sample(s) {rows[:8]}{' ...' if len(rows) > 8 else ''} have a gradient norm of {norm} "
        f"and max_norm is {bound:g}: the clip factor max_norm / norm is below {name}'s smallest normal number "
        f"({tiny:.2g}), so {name} would round it by up to 100% and the clipped gradient could exceed max_norm. Use a "
        f"larger max_norm, or {fix}")


def clip_per_sample(grads: Grads, max_norm: float) -> tuple[Grads, torch.Tensor]:
    """Scale each sample's gradient so that its L2 norm (over all parameters) is at most ``max_norm``.

    Sample i is multiplied by ``min(1, max_norm / (norm_i + 1e-6))``, as in DP-SGD (Opacus): gradients
    already within the bound are returned unchanged, longer ones keep their direction.

    Args:
        grads: a flat (B, P) tensor, or ``{name: Tensor (B, *param.shape)}`` with the same B everywhere.
        max_norm: the bound, a finite number > 0 (any real scalar: a float, a numpy scalar, a 0-dim tensor).

    Returns:
        ``(clipped, norms)``: ``clipped`` has the structure of ``grads`` (new tensors; the input is not
        modified), ``norms`` is (B,), each sample's norm before clipping.

    Raises:
        ValueError: ``max_norm`` not a finite positive number, an empty dict, a tensor that is not (B, P),
            dict entries with different B, dtypes or devices; TypeError: ``grads`` of another type.
    """
    max_norm = _bound(max_norm)
    norms = _norms(grads)
    factor = (max_norm / (norms.double() + EPS)).clamp(max=1.0)  # (B,), float64: float16's may be subnormal

    def clipped(g: torch.Tensor) -> torch.Tensor:  # the product in float32 at least, rounded to g's dtype once
        wide = factor.to(torch.promote_types(g.dtype, torch.float32)).view(-1, *(1,) * (g.dim() - 1))
        return (g * wide).to(g.dtype)

    if isinstance(grads, torch.Tensor):
        return clipped(grads), norms
    return {name: clipped(g) for name, g in grads.items()}, norms


def dp_sgd_gradient(grads: Grads, max_norm: float, noise_multiplier: float,
                    generator: torch.Generator | None = None) -> Grads:
    """The DP-SGD gradient: the sum over samples of the clipped gradients, plus Gaussian noise.

    ``sum_i clip(g_i) + N(0, (noise_multiplier * max_norm)^2 I)``; divide by the (expected) batch size
    yourself for the averaged gradient Opacus hands the optimiser.

    Args:
        grads: a flat (B, P) tensor, or ``{name: Tensor (B, *param.shape)}``.
        max_norm: the clipping bound, a finite number > 0.
        noise_multiplier: the noise standard deviation relative to ``max_norm``, a finite number >= 0.
        generator: a ``torch.Generator`` on the gradients' device, for reproducible noise (drawn in the
            dict's order); None uses the global generator.

    Returns:
        One gradient: (P,) for flat input, else ``{name: Tensor (*param.shape)}``.

    Raises:
        ValueError: as :func:`clip_per_sample`, a negative or non-finite ``noise_multiplier``, or a
            ``generator`` on another device than the gradients; TypeError: ``generator`` not a Generator.
    """
    max_norm = _bound(max_norm)
    noise_multiplier = real_number("noise_multiplier", noise_multiplier, hint=" (0 adds no noise)")
    sample = grads if isinstance(grads, torch.Tensor) else next(iter(grads.values()), None)
    if generator is not None and sample is not None:  # checked before the (B, P) clipped copy is made
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(generator).__name__}")
        if generator.device.type != sample.device.type:
            raise ValueError(
                f"generator is on {generator.device} but the gradients are on {sample.device}; create it with "
                f"torch.Generator(device={str(sample.device)!r}).manual_seed(seed)"
            )
    clipped, _norms = clip_per_sample(grads, max_norm)
    tensors = {"": clipped} if isinstance(clipped, torch.Tensor) else clipped
    std = noise_multiplier * max_norm
    result = {}
    for name, g in tensors.items():
        total = g.sum(0)
        if std > 0:
            total = total + std * torch.randn(total.shape, generator=generator, dtype=total.dtype,
                                              device=total.device)
        result[name] = total
    return result[""] if isinstance(clipped, torch.Tensor) else result


def _bound(max_norm: object) -> float:
    return real_number("max_norm", max_norm, positive=True, hint=" (the largest L2 norm a sample may keep)")


def _norms(grads: Grads) -> torch.Tensor:
    """(B,) L2 norm of each sample over all parameters; validates the structure."""
    if isinstance(grads, torch.Tensor):
        if grads.dim() != 2 or not grads.is_floating_point():
            raise ValueError(
                f"a flat gradient must be a floating-point (B, P) tensor, got {tuple(grads.shape)} {grads.dtype}; "
                "use per_sample_grads(..., flat=True), or pass the dict {name: (B, *param.shape)}"
            )
        return row_norms(grads)  # accumulated in float64: a float32 norm over 1.8e19 is not inf
    if not isinstance(grads, dict):
        raise TypeError(
            f"grads must be a (B, P) tensor or a dict {{name: (B, *param.shape)}}, got {type(grads).__name__}"
        )
    if not grads:
        raise ValueError("grads is an empty dict: pass at least one parameter's per-sample gradients")
    first_name, first = next(iter(grads.items()))
    for name, g in grads.items():
        if not isinstance(g, torch.Tensor) or g.dim() == 0 or not g.is_floating_point():
            raise ValueError(f"grads[{name!r}] must be a floating-point tensor (B, *param.shape), got {g!r:.80}")
        if g.shape[0] != first.shape[0] or g.dtype != first.dtype or g.device != first.device:
            raise ValueError(
                f"grads[{name!r}] is ({g.shape[0]}, ...) {g.dtype} on {g.device} but grads[{first_name!r}] is "
                f"({first.shape[0]}, ...) {first.dtype} on {first.device}: every entry needs the same samples "
                "first, one dtype and one device (as per_sample_grads returns them)"
            )
    squared = torch.stack([wide_square(row_norms(sample_rows(g))) for g in grads.values()])  # float64
    return squared.sum(0).sqrt().to(first.dtype)


def clipping_groups(names: tuple[str, ...], max_norm: float | None, per_layer: PerLayer) -> Groups:
    """[(bound, names)]: one group of every parameter (``per_layer=False``); one per parameter with bound
    max_norm / sqrt(K) (``True``: K parameters, so that the whole gradient stays within max_norm); or by the dict's
    module prefixes (a parameter's name or a module path of it, matched at dots), each parameter in the group of its
    longest prefix (``""`` matches every name)."""
    if per_layer is False:
        return [(float(max_norm), names)]
    if per_layer is True:
        bound = float(max_norm) / math.sqrt(len(names))
        return [(bound, (n,)) for n in names]
    members: dict[str, list[str]] = {key: [] for key in per_layer}
    for name in names:
        keys = [k for k in per_layer if k == "" or name == k or name.startswith(k + ".")]
        if not keys:
            raise ValueError(
                f"the trainable parameter {name!r} is in no group of per_layer (keys: {list(per_layer)}); add its "
                "name or a module prefix of it, or '' for every parameter not named otherwise"
            )
        members[max(keys, key=len)].append(name)
    unmatched = [k for k in per_layer if k and not any(n == k or n.startswith(k + ".") for n in names)]
    if unmatched:  # a typo would leave its layer in a group with another bound, unnoticed
        raise ValueError(
            f"per_layer key(s) {unmatched} match no trainable parameter (a key is a parameter's name or a module "
            f"prefix of it, e.g. {names[0].rsplit('.', 1)[0]!r}; a weight tied to another has one name, its first in "
            f"named_parameters()); trainable parameters: {list(names)[:6]}{' ...' if len(names) > 6 else ''}"
        )
    return [(float(per_layer[k]), tuple(ns)) for k, ns in members.items() if ns]


def noise_std(noise_multiplier: float, groups: Groups) -> float:
    """noise_multiplier x the largest norm of one sample's clipped gradient, sqrt(sum_k C_k^2) (no overflow of the
    squares: a bound of 1e155); ValueError where the product is not finite."""
    std = noise_multiplier * math.hypot(*(bound for bound, _ in groups)) if noise_multiplier else 0.0
    if not math.isfinite(std):
        raise ValueError(f"the noise's std (noise_multiplier x sqrt(sum of the squared bounds)) is {std}: pass "
                         "bounds and a noise multiplier whose product is finite")
    return std
