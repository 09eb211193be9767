"""nn.Linear, on inputs (B, in) or with extra dimensions (B, *, in); and the same map with its weight stored
(in, out), y = x W + b (Hugging Face's ``Conv1D``, registered in ``integrations/transformers.py``)."""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Sequence

import torch
from torch import nn

from pergrad_viz.core.numbers import row_dots, wide_square
from pergrad_viz.rules.doubts import deferring, note_grams, tops_fit
from pergrad_viz.rules.registry import join_positions, positions, register, register_ghost, register_weighted_sum
from pergrad_viz.rules.scaling import scaled_unless_fit, wide_row_norms


@register(nn.Linear, features=lambda module: 1)
def linear(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
           out: dict[str, torch.Tensor]) -> None:
    n, batch = grad_output.shape[:2]
    if activation.dim() == 2:  # (B, in): the weight gradient is an outer product, written in place
        if "weight" in out:
            _outer(grad_output, activation, out["weight"])
        if "bias" in out:
            out["bias"].copy_(grad_output)
        return
    a = positions(activation, batch)  # (B, T, in)
    g = positions(grad_output, n, batch)  # (N, B, T, out)
    if "weight" in out:
        token_outer_sum(g, a, out["weight"])
    if "bias" in out:
        torch.sum(g, dim=2, out=out["bias"])


SMALL_BLOCK_BYTES = 1 << 20  # a row of per-sample blocks up to this size is written through a temporary
WIDE_BLOCK_BYTES = 6 << 20  # ... and up to this size where each block has fewer rows than columns (see below)


def token_outer_sum(g: torch.Tensor, a: torch.Tensor, dest: torch.Tensor, in_out: bool = False) -> None:
    """dest[n, b] = sum_t outer(g[n, b, t], a[b, t]): g (N, B, T, out), a (B, T, in), dest (N, B, out, in); with
    ``in_out`` its transpose, sum_t outer(a[b, t], g[n, b, t]) into dest (N, B, in, out).

    One batched matmul per row n, straight into ``dest``, also where its rows are strided views of a flat (B, P)
    result; for small blocks of a flat result into a temporary, then copied, which is faster there (measured on 2
    cores: 35 against 62 us for 0.5 MiB, even at 1 MiB, and 1.5-7x slower from 8 MiB, where the temporary's fresh
    pages cost more than the strided write). Blocks with fewer rows than columns (a ViT's MLP output layer, 128 x
    512) are written slowly into strided views up to several MiB: 16 x (128, 512) blocks, 4 MiB, 625 us strided
    against 272 us through a temporary; 16 x (128, 768), 6 MiB, 1186 against 759 us; taller blocks of the same size
    are as fast either way (16 x (512, 128): 268 against 269 us)."""
    rows, cols = dest.shape[-2:]
    limit = WIDE_BLOCK_BYTES if rows < cols else SMALL_BLOCK_BYTES
    for r in range(g.shape[0]):
        left, right = (a.mT, g[r]) if in_out else (g[r].mT, a)
        if dest[r].is_contiguous() or dest[r].numel() * dest.element_size() > limit:
            torch.bmm(left, right, out=dest[r])
        else:
            dest[r].copy_(torch.bmm(left, right))


def linear_in_out(module: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor,
                  out: dict[str, torch.Tensor]) -> None:
    """A Linear whose weight is stored (in, out), y = x W + b: activation (B, *, in), grad_output (N, B, *, out),
    out["weight"] (N, B, in, out) = sum over positions of outer(a_t, g_t), out["bias"] (N, B, out)."""
    n, batch = grad_output.shape[:2]
    a = positions(activation, batch)  # (B, T, in)
    g = positions(grad_output, n, batch)  # (N, B, T, out)
    if "weight" in out:
        token_outer_sum(g, a, out["weight"], in_out=True)
    if "bias" in out:
        torch.sum(g, dim=2, out=out["bias"])


# Per-sample blocks of at least this many elements are written by a batched matmul, which writes large
# blocks faster than the broadcasting multiply (and into strided result views with less copying).
BMM_BLOCK = 32768


def _outer(g: torch.Tensor, a: torch.Tensor, out: torch.Tensor) -> None:
    """out[n, b] = outer(g[n, b], a[b]): g (N, B, out), a (B, in), out (N, B, out, in)."""
    if g.shape[0] == 1 and out.shape[-1] * out.shape[-2] >= BMM_BLOCK:
        torch.bmm(g[0].unsqueeze(2), a.unsqueeze(1), out=out[0])
    else:
        torch.mul(g.unsqueeze(-1), a.unsqueeze(1), out=out)


def gram_is_cheaper(tokens: int, layer_params: int) -> bool:
    """Norms of a Linear on T tokens: two (B, T, T) Gram matrices beat the (B, out, in) gradient if T^2 < in*out."""
    return tokens * tokens < layer_params


def gram_is_faster(tokens: int, width_in: int, width_out: int) -> bool:
    """A Linear's norms on T tokens: its two (B, T, T) Gram matrices, T^2 (in + out) products a sample, where that is
    at most its (B, out, in) gradient's T in out (2 cores, B=32, interleaved: the gradient 1.26x faster at T=197,
    192 -> 576, a ViT-Tiny's attention, 1.58x at T=100, 64 -> 256; the Grams 1.07x faster at the tie, T=64,
    128 -> 128). Where T^2 >= in out (:func:`gram_is_cheaper` false) the gradient is faster too."""
    return tokens * (width_in + width_out) <= width_in * width_out


@functools.lru_cache(maxsize=4096)
def instantiating_is_cheaper(tokens: int, width_in: int, width_out: int, batch: int, layer_params: int,
                             held: int) -> bool:
    """Whether book-keeping should form a layer's per-sample weight gradient (B, out, in) on T ``tokens`` (B = ``batch``
    samples), take its norm and add it into the sum (one ``addmm_``), instead of the ghost norm and then the share
    ``(c G)^T A``: where the norm forms that gradient anyway (:func:`gram_is_faster` false), so that the share would
    repeat its T-fold product (2 cores: a ViT's layers on 197 tokens, LoRA adapters, ResNet-18's RGB stem), and where
    it holds no more numbers than ``held``, those of the layer's input and output gradient, which book-keeping would
    hold until the share instead (a ViT on 224 x 224 images: the same peak tensor memory, 1.15x plain). Where the
    Grams are faster they stay faster (a BERT's 128 -> 128 layers on 32 tokens: 1.62x a plain step with them, 1.77x
    with these gradients)."""
    return not gram_is_faster(tokens, width_in, width_out) and batch * layer_params <= held


@register_ghost(nn.Linear)
class LinearGhost:
    """||sum_t g_t a_t^T||^2 = sum_{t,s} (a_t . a_s)(g_t . g_s): the ghost norm (T = 1: ||g||^2 ||a||^2)."""

    kind = "linear"

    @staticmethod
    def applies(module):
        return True

    @staticmethod
    def stack(module, seen):
        acts, grads = [], []
        for a, g in seen:
            n, batch = g.shape[:2]
            acts.append(positions(a, batch))
            grads.append(positions(g, n, batch))
        return join_positions(acts, grads)

    @staticmethod
    def squared_norms(module, a, g, local):
        result = {}
        tokens = a.shape[1]
        if tokens == 1:  # the ghost norm: ||g a^T||^2 = ||g||^2 ||a||^2, and ||g||^2 for the bias
            g_norm = wide_row_norms(g[:, 0])  # float64
            if "weight" in local:
                result["weight"] = (g_norm * wide_row_norms(a[:, 0])).square()  # 0 * huge: 0
            if "bias" in local:
                result["bias"] = g_norm.square()
            return result
        gram = gram_is_faster(tokens, a.shape[-1], g.shape[-1])
        noting = deferring(a, g)  # a caller reads the Grams' range later for all layers (a GPU: no read here)
        if "weight" in local and (a.device.type == "cpu" or noting) and gram:
            grams = torch.bmm(a, a.mT), torch.bmm(g, g.mT)  # (B, T, T) each, as they are
            if noting or grams_fit(*grams, a.shape[-1], g.shape[-1]):  # summed in their dtype (in float64: 6x slower)
                batch = grams[0].shape[0]  # sum_{t,s} aa gg: one dot product per sample
                result["weight"] = row_dots(grams[0].view(batch, -1), grams[1].view(batch, -1)).clamp_min(0)
                if noting:  # the range and the cancellation read later, for every layer at once
                    note_grams(*grams, tokens * tokens, a.shape[-1], g.shape[-1],
                               cancelling(result["weight"], *grams, a.shape[-1], g.shape[-1]))
                else:
                    recompute_cancelled(result["weight"], *grams, a, g)
                if "bias" in local:  # ||sum_t g_t||^2 from the sum itself (from the Gram it would cancel alike)
                    result["bias"] = g.sum(1).square().sum(1)
                return result
            del grams  # extreme values: scaled below
        a, g, scale, bias_scale = scaled_unless_fit(a, g, tokens * tokens * a.shape[-1] * g.shape[-1])
        if "weight" in local:
            if gram:
                grams = torch.bmm(a, a.mT), torch.bmm(g, g.mT)
                weight = (grams[0] * grams[1]).sum((1, 2)).clamp_min(0)
                recompute_cancelled(weight, *grams, a, g)
                del grams
            else:  # (B, out, in), this layer only
                weight = wide_square(torch.linalg.vector_norm(torch.bmm(g.mT, a).flatten(1), dim=1))  # no squared copy
            result["weight"] = weight if scale is None else weight.to(scale.dtype) * scale
        if "bias" in local:
            bias = g.sum(1).square().sum(1)
            result["bias"] = bias if bias_scale is None else bias.to(bias_scale.dtype) * bias_scale
        return result

    @staticmethod
    def instantiates(module, seen):
        if len(seen) != 1:
            return False
        a, g = seen[0]
        return instantiating_is_cheaper(math.prod(a.shape[1:-1]), a.shape[-1], g.shape[-1], a.shape[0],
                                        module.weight.numel(), a.numel() + g.numel())

    @staticmethod
    def factors(module, a, g):
        return g, a  # W (out, in): sum_t outer(g_t, a_t)

    @staticmethod
    def overlap(a1, a2, dtype):
        return torch.einsum("itk,jsk->ijts", a1, a2)  # a_{i,t} . a_{j,s}

    @staticmethod
    def gram_cost(module, tokens, y_count, pairs):
        return _gram_cost(module.in_features, module.out_features, tokens, y_count, pairs)


def grams_fit(aa: torch.Tensor, gg: torch.Tensor, width_a: int, width_g: int) -> bool:
    """Whether a Linear's Gram norm ``sum_{t,s} aa[t, s] gg[t, s]`` from the Grams (B, T, T) of its unscaled inputs
    (``width_a`` features) and output gradients (``width_g``) is as exact as from scaled ones, read from their
    diagonals (B, T) alone, after the fact, on the host (CPUs only: there it is free): every diagonal finite (no
    square overflowed: an entry is at most its diagonal's), their product times T^2 far below the dtype's largest
    number (the sum cannot overflow), and each sample's largest diagonal entry 0 or at least ``width`` times
    ``tiny / eps`` (the terms lost to underflow, at most ``width * tiny`` an entry, stay below the sum's own
    rounding). Else the caller scales the samples (:func:`~pergrad_viz.rules.scaling.scaled_unless_fit`); this
    replaces four reductions over (B, T, width) tensors by two over (B, T)."""
    if aa.device.type != "cpu" or not aa.numel():
        return False
    if aa.dtype == gg.dtype and aa.shape[1] == gg.shape[1]:  # both diagonals' maxima in one reduction, one read
        top_a, top_g = torch.stack((aa.diagonal(dim1=1, dim2=2), gg.diagonal(dim1=1, dim2=2))).amax(2).tolist()
    else:
        top_a = aa.diagonal(dim1=1, dim2=2).amax(1).tolist()
        top_g = gg.diagonal(dim1=1, dim2=2).amax(1).tolist()
    return tops_fit(top_a, top_g, (aa.dtype, gg.dtype), aa.shape[-1] ** 2, width_a, width_g)


# A Gram norm sum_{t,s} (a_t . a_s)(g_t . g_s) is recomputed in float64 for a sample where it is under this many
# times its rounding error's usual size, eps (sqrt(in) + sqrt(out) + T) sum_t |a_t|^2 |g_t|^2 (about the norm itself
# where the tokens' terms do not cancel; where they do, the float32 sum loses every digit: norms 0 and 32 for 3-5).
CANCELLATION = 1000.0


def cancelling(weight: torch.Tensor, aa: torch.Tensor, gg: torch.Tensor, width_a: int, width_g: int) -> torch.Tensor:
    """(B,) bool: the samples whose Gram norm ``weight`` (B,), from the Grams aa, gg (B, T, T) of inputs of ``width_a``
    features and output gradients of ``width_g``, may have lost its digits to the cancellation of the tokens' terms
    (:data:`CANCELLATION`, :func:`below_rounding`); Grams of float16 and bfloat16 none (:func:`guarded`)."""
    if not guarded(aa, gg):
        return torch.zeros_like(weight, dtype=torch.bool)
    usual = row_dots(aa.diagonal(dim1=1, dim2=2).to(weight.dtype), gg.diagonal(dim1=1, dim2=2).to(weight.dtype))
    return below_rounding(weight, usual, width_a, width_g, aa.shape[-1], aa.dtype)


def guarded(*grams: torch.Tensor) -> bool:
    """Whether Grams of these dtypes get the cancellation guard: float32 and float64 (a Gram norm squares what
    cancels: tokens sharing a part 1e8 times their differences, output gradients of alternating signs, left float64
    a norm of 0 against 1.1e4; a probe); not float16 and bfloat16, which round at 1e-3 to 1e-2 however a norm is
    formed, so that every sample would be computed again."""
    return all(t.dtype in (torch.float32, torch.float64) for t in grams)


def below_rounding(norms: torch.Tensor, usual: torch.Tensor, width_a: int, width_g: int, terms: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(B,) bool: squared norms under :data:`CANCELLATION` times the usual size of their rounding in ``dtype`` (the
    Grams'), eps (sqrt(width_a) + sqrt(width_g) + terms) ``usual``, for sums over ``terms`` positions of products of
    Gram entries over ``width_a`` and ``width_g`` features (``usual`` (B,): those sums' size where nothing cancels)."""
    bound = CANCELLATION * torch.finfo(dtype).eps * (math.sqrt(width_a) + math.sqrt(width_g) + terms)
    return norms < usual * bound


EXPLICIT_BYTES = 16 << 20  # a recomputed sample's gradient is formed this many bytes of output rows at a time


def recompute_cancelled(weight: torch.Tensor, aa: torch.Tensor, gg: torch.Tensor, a: torch.Tensor,
                        g: torch.Tensor) -> None:
    """Write into ``weight`` (B,) the norms of the samples :func:`cancelling` picks, from a (B, T, in) and g (B, T,
    out): their gradients g^T a formed in float64 (:func:`gradient_squared_norms`), one host read (free on a CPU,
    rare elsewhere)."""
    if not guarded(aa, gg):  # none can be picked: no host read (a GPU would synchronise)
        return
    rows = cancelling(weight, aa, gg, a.shape[-1], g.shape[-1]).nonzero().flatten()
    if rows.numel():
        weight[rows] = gradient_squared_norms([(g[rows], a[rows])]).to(weight.dtype)


def gradient_squared_norms(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """(R,) squared norms of R samples' gradients of one weight (rows, cols), each ``sum_k sum_t outer(left_kt,
    right_kt)`` formed in float64 (what cancels is rounded once, not squared as in a Gram form): pairs of a left
    factor (R, T_k, rows), or (R, T_k) integer rows (one-hot: an Embedding's ids), and a right factor (R, T_k, cols)
    (a Linear's: its output gradients and inputs). A block of rows at a time, at most :data:`EXPLICIT_BYTES` (a GPT-2
    head's (V, D) need not be held at once)."""
    width = pairs[0][1].shape[-1]
    height = max(left.shape[-1] if left.is_floating_point() else int(left.max()) + 1 if left.numel() else 0
                 for left, _ in pairs)
    step = max(1, EXPLICIT_BYTES // (8 * max(1, width)))
    result = torch.zeros(pairs[0][1].shape[0], dtype=torch.float64, device=pairs[0][1].device)
    for r in range(result.shape[0]):
        wide = [(left[r], right[r].double()) for left, right in pairs]  # (T_k, rows) or (T_k,), (T_k, cols)
        for first in range(0, height, step):
            block = torch.zeros(min(step, height - first), width, dtype=torch.float64, device=result.device)
            for left, right in wide:
                if left.is_floating_point():
                    block += left[:, first:first + step].double().mT.mm(right)
                else:
                    kept = (left >= first) & (left < first + step)
                    block.index_add_(0, left[kept] - first, right[kept])
            result[r] += block.square().sum()
    return result


def _gram_cost(width_in: int, width_out: int, tokens: int, y_count: int, pairs: int) -> tuple[int, int]:
    gram = tokens * tokens * (width_in + y_count * width_out) + tokens * pairs * width_out
    return gram, pairs * width_in * width_out


class LinearInOutGhost(LinearGhost):
    """:class:`LinearGhost` for a Linear whose weight is stored (in, out): the same Gram form (norms and kernels do
    not see the layout); registered with :func:`linear_in_out`."""

    @staticmethod
    def factors(module, a, g):
        return a, g  # W (in, out): sum_t outer(a_t, g_t)

    @staticmethod
    def gram_cost(module, tokens, y_count, pairs):
        width_in, width_out = module.weight.shape
        return _gram_cost(width_in, width_out, tokens, y_count, pairs)


def _scaled(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """t (B, *, width) with sample b's rows times weights[b], as (B * T, width)."""
    return positions(t * weights.view(-1, *(1,) * (t.dim() - 1)))


def _linear_sums(seen, weights: dict[str, torch.Tensor], out: dict[str, torch.Tensor], in_out: bool,
                 fresh: Collection[str]) -> None:
    """out += sum_b c_b sum_t g_bt a_bt^T = G^T diag(c) A over the B * T rows of every call: one ``addmm_`` per call
    and weight, straight into ``out`` (``in_out``: the weight stored (in, out)), c applied to the narrower of A and G
    (the one temporary, (B * T, min(in, out))); the bias += G summed over positions, times c (one ``addmv_``). The
    first product into a ``fresh`` tensor is written (``beta=0``: its old contents are not read)."""
    fresh = set(fresh)
    converted: dict[int, torch.Tensor] = {}  # a weight and its bias share c (flat clipping): converted once
    for a, g in seen:
        batch = g.shape[0]
        rows_a, rows_g = positions(a), positions(g)  # (B * T, in), (B * T, out)
        for ln, c in weights.items():
            c = converted[id(c)] if id(c) in converted else converted.setdefault(id(c), c.to(g.dtype))
            beta = 0 if ln in fresh else 1
            fresh.discard(ln)
            if ln == "bias":
                per_sample = rows_g if rows_g.shape[0] == batch else positions(g, batch).sum(1)
                out[ln].addmv_(per_sample.mT, c, beta=beta)
                continue
            if rows_a.shape[1] <= rows_g.shape[1]:
                left, right = rows_g, _scaled(a, c)
            else:
                left, right = _scaled(g, c), rows_a
            if in_out:
                out[ln].addmm_(right.mT, left, beta=beta)
            else:
                out[ln].addmm_(left.mT, right, beta=beta)


@register_weighted_sum(nn.Linear, writes_fresh=True)
def linear_weighted_sum(module, seen, weights, out, fresh=()):
    """nn.Linear: weight (out, in) += (c G)^T A, bias (out,) += the c-weighted sum of the output gradients."""
    _linear_sums(seen, weights, out, False, fresh)


def linear_in_out_weighted_sum(module, seen, weights, out, fresh=()):
    """A Linear with its weight stored (in, out): weight += A^T (c G); registered with :func:`linear_in_out`."""
    _linear_sums(seen, weights, out, True, fresh)
