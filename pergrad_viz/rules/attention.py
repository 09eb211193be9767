"""nn.MultiheadAttention on batched input: batch_first or not, self- or cross-attention (also with kdim / vdim of
their own, i.e. separate q / k / v projection weights), with or without biases, add_bias_kv, add_zero_attn,
attn_mask (L, S) or (B * heads, L, S), bool or float, key_padding_mask (B, S), is_causal, need_weights with or
without averaging over the heads. No dropout (dropout in training mode is refused before any rule runs).

Samples do not interact inside attention, so the rule replays the layer's forward on the B samples at once with
the layer's weights (the semantics of ``F.multi_head_attention_forward``), then backpropagates the N output
gradients through it by hand, batched over N. Per head, with P = softmax(scale * q k^T + mask), O = P v::

    dP = dO v^T (+ the gradient of the returned attention weights)      dv = P^T dO
    dS = P * (dP - rowsum(dP * P))      dq = scale * dS k      dk = scale * dS^T q

Every projection is a Linear applied at every token, so its per-sample gradient is a sum over tokens of outer
products::

    d in_proj_weight[0:E]  = sum_t outer(dq[t], query[t])    (dk with the key tokens, dv with the value tokens)
    d out_proj.weight      = sum_t outer(g[t], o[t])          (o: the attention output before out_proj)
    biases: sums over tokens; bias_k, bias_v: the gradients of the appended key / value token.

Shapes: B samples, L query tokens, S key / value tokens (S' with the bias_kv and zero-attention tokens), E =
embed_dim, H heads of d = E / H; N = 1 for loss gradients, N = Y for output Jacobians.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import combinations

import torch
import torch.nn.functional as F
from torch import nn

from . import register_call

# key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal: forward's defaults after (q, k, v)
_DEFAULTS = (None, True, None, True, False)


@dataclass
class Attention:
    """One call of the layer replayed on the B samples (batch first), with what the backward needs."""

    query: torch.Tensor  # (B, L, E)
    key: torch.Tensor  # (B, S, kdim)
    value: torch.Tensor  # (B, S, vdim)
    q: torch.Tensor  # (B, H, L, d), unscaled
    k: torch.Tensor  # (B, H, S', d)
    v: torch.Tensor  # (B, H, S', d)
    probs: torch.Tensor  # (B, H, L, S'): the attention weights of every head
    merged: torch.Tensor  # (B, L, E): the attention output before out_proj
    scale: float  # 1 / sqrt(d)
    need_weights: bool
    average: bool
    self_attention: bool  # query, key and value are the same tokens (one matmul for all of in_proj_weight)

    def output(self, module: nn.MultiheadAttention) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the layer returned: attn_output (B, L, E) or (L, B, E), and the weights (B, [H,] L, S') or None."""
        out = F.linear(self.merged, module.out_proj.weight, module.out_proj.bias)
        if not module.batch_first:
            out = out.transpose(0, 1)
        if not self.need_weights:
            return out, None
        return out, self.probs.mean(1) if self.average else self.probs


def _supports(module: nn.Module) -> bool:
    """Every configuration MultiheadAttention can be built with (bias_k and bias_v come together)."""
    return (module.bias_k is None) == (module.bias_v is None)


@register_call(nn.MultiheadAttention, supports=_supports)
def multihead_attention(module: nn.Module, inputs: tuple, grad_outputs: list, out: dict[str, torch.Tensor]) -> None:
    """inputs ``(query, key, value[, key_padding_mask, need_weights, attn_mask, average_attn_weights, is_causal])``:
    query (B, L, E) or (L, B, E), key (B, S, kdim), value (B, S, vdim) (or sequence first); grad_outputs
    ``[attn_output (N, *attn_output.shape)]``, and ``attn_weights (N, B, [H,] L, S')`` when weights are returned."""
    if inputs[0].dim() != 3:
        raise NotImplementedError(f"MultiheadAttention on unbatched input of shape {tuple(inputs[0].shape)}")
    if module.training and module.dropout > 0:
        raise NotImplementedError("MultiheadAttention with dropout in training mode")
    if not out:
        return
    with torch.no_grad():
        _backward(module, recompute(module, _arguments(module, inputs, grad_outputs)), grad_outputs, out)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True: not attended) as a float one (-inf there, 0 elsewhere); a float mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def _is_causal(mask: torch.Tensor | None, length: int) -> bool:
    """Whether mask is the (L, L) causal mask: True / -inf above the diagonal, False / 0 elsewhere."""
    if mask is None or tuple(mask.shape) != (length, length):
        return False
    above = torch.ones(length, length, dtype=torch.bool, device=mask.device).triu_(1)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, above))
    return bool(((mask == float("-inf")) == above).all() and (mask.masked_fill(above, 0) == 0).all())


def _arguments(module: nn.MultiheadAttention, inputs: tuple, grad_outputs: list) -> tuple:
    """All eight arguments of the call in forward's order, defaults filled in.

    ``inputs`` may also hold only the arguments *given*, in forward's order but with the skipped ones left out
    (keyword arguments bound without their defaults: ``mha(q, k, v, need_weights=False)`` as ``(q, k, v, False)``).
    Then every placement of the given values into the five optional slots is tried; those that fit (types,
    mask shapes, need_weights and average_attn_weights as the returned outputs show, is_causal only with a mask)
    must all mean the same call, else NotImplementedError.
    """
    query, key, value, *rest = inputs
    if len(rest) == len(_DEFAULTS):
        return tuple(inputs)
    batch_first = module.batch_first
    batch, length = query.shape[:2] if batch_first else query.shape[1::-1]
    source = key.shape[1] if batch_first else key.shape[0]
    weights = len(grad_outputs) > 1
    heads = module.num_heads
    extra = module.bias_k is not None or module.add_zero_attn

    def fits(kpm, need_weights, attn_mask, average, is_causal) -> bool:
        if any(isinstance(f, torch.Tensor) or f is None for f in (need_weights, average, is_causal)):
            return False
        if not all(m is None or isinstance(m, torch.Tensor) for m in (kpm, attn_mask)):
            return False
        if kpm is not None and tuple(kpm.shape) != (batch, source):
            return False
        if attn_mask is not None and tuple(attn_mask.shape) not in ((length, source), (batch * heads, length, source)):
            return False
        if bool(need_weights) != weights or (is_causal and attn_mask is None):
            return False
        return not weights or grad_outputs[1].dim() == (4 if average else 5)  # (N, B, [H,] L, S')

    def meaning(args: tuple) -> tuple:
        kpm, need_weights, attn_mask, average, is_causal = args
        causal_used = bool(is_causal) and kpm is None and not need_weights  # otherwise the mask is used
        if not causal_used and kpm is None and not need_weights and not extra and _is_causal(attn_mask, length):
            causal_used = True  # the same as the is_causal hint (with no appended key, whose column differs)
        return (id(kpm), bool(need_weights), None if causal_used else id(attn_mask),
                bool(average) or not need_weights, causal_used)

    found: dict[tuple, tuple] = {}
    for slots in combinations(range(len(_DEFAULTS)), len(rest)):
        args = list(_DEFAULTS)
        for slot, v in zip(slots, rest, strict=True):
            args[slot] = v
        if fits(*args):
            found.setdefault(meaning(tuple(args)), tuple(args))
    if len(found) != 1:
        raise NotImplementedError(
            "MultiheadAttention rule: cannot tell which of forward's arguments (key_padding_mask, need_weights, "
            "attn_mask, average_attn_weights, is_causal) the call's extra arguments were; pass all of them")
    return (query, key, value, *next(iter(found.values())))


def recompute(module: nn.MultiheadAttention, inputs: tuple) -> Attention:
    """The layer's forward on the call's arguments in forward's order (see :func:`multihead_attention`; any
    left out at the end take their defaults), batch first."""
    query, key, value, *rest = inputs
    kpm, need_weights, attn_mask, average, is_causal = (*rest, *_DEFAULTS[len(rest):])
    self_attention = _same(query, key) and _same(key, value)
    if not module.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    batch, length, embed = query.shape
    source = key.shape[1]
    heads, dim = module.num_heads, module.head_dim
    dtype = query.dtype

    if module._qkv_same_embed_dim:
        w_q, w_k, w_v = module.in_proj_weight.chunk(3)
    else:
        w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
    b_q, b_k, b_v = (None, None, None) if module.in_proj_bias is None else module.in_proj_bias.chunk(3)
    if self_attention and module._qkv_same_embed_dim:
        q, k, v = F.linear(query, module.in_proj_weight, module.in_proj_bias).chunk(3, dim=-1)
    else:
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)  # (B, T, E)
    extra = []  # tokens appended to the keys and values: bias_kv, then zero attention
    if module.bias_k is not None:
        extra.append((module.bias_k.reshape(1, 1, embed), module.bias_v.reshape(1, 1, embed)))
    if module.add_zero_attn:
        zero = q.new_zeros(1, 1, embed)
        extra.append((zero, zero))
    if extra:
        k = torch.cat([k, *(ek.expand(batch, 1, embed) for ek, _ in extra)], dim=1)
        v = torch.cat([v, *(ev.expand(batch, 1, embed) for _, ev in extra)], dim=1)
    total = source + len(extra)

    q = q.reshape(batch, length, heads, dim).transpose(1, 2)  # (B, H, L, d)
    k = k.reshape(batch, total, heads, dim).transpose(1, 2)  # (B, H, S', d)
    v = v.reshape(batch, total, heads, dim).transpose(1, 2)

    mask = None  # additive, broadcastable to (B, H, L, S')
    if is_causal and kpm is None and not need_weights:  # the is_causal hint wins over attn_mask (SDPA's causal)
        causal = torch.ones(length, total, dtype=torch.bool, device=q.device).triu_(1)
        mask = _additive(causal, dtype)
    else:
        attn_mask = _additive(attn_mask, dtype)
        if attn_mask is not None:
            attn_mask = F.pad(attn_mask, (0, len(extra)))
            mask = attn_mask if attn_mask.dim() == 2 else attn_mask.view(batch, heads, length, total)
        kpm = _additive(kpm, dtype)
        if kpm is not None:
            kpm = F.pad(kpm, (0, len(extra))).view(batch, 1, 1, total)
            mask = kpm if mask is None else mask + kpm

    scale = 1.0 / math.sqrt(dim)
    scores = torch.matmul(q * scale, k.transpose(-1, -2))  # (B, H, L, S')
    if mask is not None:
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    if mask is not None and not need_weights:  # SDPA's safe softmax: rows with every key masked attend to nothing
        probs = probs.masked_fill((scores == float("-inf")).all(-1, keepdim=True), 0.0)
    merged = torch.matmul(probs, v).transpose(1, 2).reshape(batch, length, embed)
    return Attention(query, key, value, q, k, v, probs, merged, scale, bool(need_weights), bool(average),
                     self_attention)


def _outer_sum(g: torch.Tensor, a: torch.Tensor, dest: torch.Tensor) -> None:
    """dest[n, b] = sum_t outer(g[n, b, t], a[b, t]): g (N, B, T, out), a (B, T, in), dest (N, B, out, in)."""
    if dest[0, 0].is_contiguous():  # straight into the result, no temporary of its size
        for r in range(g.shape[0]):
            torch.bmm(g[r].transpose(1, 2), a, out=dest[r])
    else:
        dest.copy_(torch.matmul(g.transpose(-1, -2), a))


def _merge(x: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """Heads x (N, B, H, T, d) merged into dest (N, B, T, H * d) (a view whose last dimension is contiguous)."""
    n, batch, heads, tokens, dim = x.shape
    dest.view(n, batch, tokens, heads, dim).copy_(x.transpose(2, 3))
    return dest


def _backward(module: nn.MultiheadAttention, a: Attention, grad_outputs: list, out: dict[str, torch.Tensor]
              ) -> None:
    g = grad_outputs[0]  # (N, *attn_output.shape)
    g_w = grad_outputs[1] if len(grad_outputs) > 1 else None  # (N, B, [H,] L, S')
    n = next(iter(out.values())).shape[0]
    batch, heads, length, dim = a.q.shape
    embed, source, total = heads * dim, a.key.shape[1], a.k.shape[2]
    if g is None:
        g = a.merged.new_zeros(n, batch, length, embed)
    elif not module.batch_first:
        g = g.transpose(1, 2)  # (N, B, L, E)

    if "out_proj.weight" in out:
        _outer_sum(g, a.merged, out["out_proj.weight"])
    if "out_proj.bias" in out:
        torch.sum(g, dim=2, out=out["out_proj.bias"])
    if all(name.startswith("out_proj.") for name in out):
        return

    d_o = torch.matmul(g, module.out_proj.weight).view(n, batch, length, heads, dim).transpose(2, 3)  # (N,B,H,L,d)
    d_p = torch.matmul(d_o, a.v.transpose(-1, -2))  # (N, B, H, L, S')
    if g_w is not None:
        d_p += g_w.unsqueeze(2) / heads if a.average else g_w
    d_s = a.probs * (d_p - (d_p * a.probs).sum(-1, keepdim=True))
    d_s *= a.scale
    dq_h = torch.matmul(d_s, a.k)  # (N, B, H, L, d)
    dk_h = torch.matmul(d_s.transpose(-1, -2), a.q)  # (N, B, H, S', d)
    dv_h = torch.matmul(a.probs.transpose(-1, -2), d_o)  # (N, B, H, S', d)

    if "bias_k" in out:
        out["bias_k"].copy_(dk_h[:, :, :, source].reshape(out["bias_k"].shape))
    if "bias_v" in out:
        out["bias_v"].copy_(dv_h[:, :, :, source].reshape(out["bias_v"].shape))
    if total > source:
        dk_h, dv_h = dk_h[:, :, :, :source], dv_h[:, :, :, :source]

    w_in, b_in = out.get("in_proj_weight"), out.get("in_proj_bias")
    if a.self_attention and module._qkv_same_embed_dim:  # one (N, B, L, 3E) gradient, one matmul
        if w_in is None and b_in is None:
            return
        d_qkv = g.new_empty(n, batch, length, 3 * embed)
        for j, x in enumerate((dq_h, dk_h, dv_h)):
            _merge(x, d_qkv[..., j * embed:(j + 1) * embed])
        if w_in is not None:
            _outer_sum(d_qkv, a.query, w_in)
        if b_in is not None:
            torch.sum(d_qkv, dim=2, out=b_in)
        return

    parts = (("q_proj_weight", dq_h, a.query), ("k_proj_weight", dk_h, a.key), ("v_proj_weight", dv_h, a.value))
    for j, (name, x, tokens) in enumerate(parts):
        rows = slice(j * embed, (j + 1) * embed)
        w = out.get(name) if w_in is None else w_in[:, :, rows]
        if w is None and b_in is None:
            continue
        d = _merge(x, g.new_empty(n, batch, x.shape[3], embed))  # (N, B, T, E)
        if w is not None:
            _outer_sum(d, tokens, w)
        if b_in is not None:
            torch.sum(d, dim=2, out=b_in[:, :, rows])
