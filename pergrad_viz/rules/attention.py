"""nn.MultiheadAttention on batched input: batch_first or not, self- or cross-attention (also with kdim / vdim of
their own, i.e. separate q / k / v projection weights), with or without biases, add_bias_kv, add_zero_attn,
attn_mask (L, S) or (B * heads, L, S), bool or float, key_padding_mask (B, S), is_causal, need_weights with or
without averaging over the heads. No dropout (dropout in training mode is refused before any rule runs).

While the ``hooks`` strategy captures a call, the layer runs :func:`capture_attention`: the semantics of
``F.multi_head_attention_forward`` (the same scaled-dot-product-attention kernel where no weights are returned),
keeping the in-projection outputs q, k, v (B, T, E) of the B samples. The one backward pass to the layer outputs
then gives their gradients too, and every projection is a Linear applied at every token, so the rule only sums
outer products over the tokens::

    d in_proj_weight[0:E]  = sum_t outer(dq[t], query[t])    (dk with the key tokens, dv with the value tokens)
    d out_proj.weight      = sum_t outer(g[t], o[t])          (o: the attention output before out_proj)
    biases: sums over tokens; bias_k, bias_v: the gradients of the appended key / value token.

Shapes: B samples, L query tokens, S key / value tokens (S' with the bias_kv and zero-attention tokens), E =
embed_dim, H heads of d = E / H; N = 1 for loss gradients, N = Y for output Jacobians.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pergrad_viz.rules.linear import token_outer_sum
from pergrad_viz.rules.registry import Captured, register_call, register_linear_views

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)
_PARAMETERS = tuple(_SIGNATURE.parameters.values())[1:]  # after self: all positional-or-keyword
_POSITION = {p.name: k for k, p in enumerate(_PARAMETERS)}
_DEFAULTS = tuple(p.default for p in _PARAMETERS)
_SIMPLE = all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in _PARAMETERS)


@dataclass
class _State:
    """What the rule needs of a captured call besides the gradients of the internals."""

    merged: torch.Tensor  # (B, L, E): the attention output before out_proj, detached
    packed: bool  # internals are one (B, L, 3E) in-projection (self-attention, no appended key / value tokens)
    source: int  # S: key / value tokens before bias_kv and zero attention


def _supports(module: nn.Module) -> bool:
    """Every configuration MultiheadAttention can be built with (bias_k and bias_v come together)."""
    return (module.bias_k is None) == (module.bias_v is None)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask (True: not attended) as a float one (-inf there, 0 elsewhere); a float mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def bind(module: nn.MultiheadAttention, args: tuple, kwargs: dict) -> tuple:
    """The call's eight arguments in forward's order, defaults filled in: (query, key, value, key_padding_mask,
    need_weights, attn_mask, average_attn_weights, is_causal)."""
    if _SIMPLE and len(args) <= len(_PARAMETERS):  # by hand: inspect's bind took ~30 us a call
        values = [*args, *_DEFAULTS[len(args):]]
        for name, value in kwargs.items():
            k = _POSITION.get(name, -1)
            if k < len(args):  # unknown, or given twice: inspect raises the TypeError
                break
            values[k] = value
        else:
            if not any(v is inspect.Parameter.empty for v in values):
                return tuple(values)
    bound = _SIGNATURE.bind(module, *args, **kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments.values())[1:]


def _appended(module: nn.MultiheadAttention, query: torch.Tensor, embed: int
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Tokens appended to the keys and values, (1, 1, E) each: ``bias_k`` / ``bias_v``, then zero attention."""
    extra = []
    if module.bias_k is not None:
        extra.append((module.bias_k.reshape(1, 1, embed), module.bias_v.reshape(1, 1, embed)))
    if module.add_zero_attn:
        zero = query.new_zeros(1, 1, embed)
        extra.append((zero, zero))
    return extra


def _projections(module: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 self_attention: bool, extra: list, batch: int, embed: int):
    """The in-projections: ``(q (B, L, E), k (B, S', E), v (B, S', E), qkv (B, L, 3E) or None, packed)`` (k and v
    with the appended tokens; packed: one projection of the query gave all three)."""
    packed = self_attention and module._qkv_same_embed_dim
    qkv = None
    if packed:
        qkv = F.linear(query, module.in_proj_weight, module.in_proj_bias)  # (B, L, 3E)
        q, k, v = qkv.chunk(3, dim=-1)
    else:
        if module._qkv_same_embed_dim:
            w_q, w_k, w_v = module.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
        b_q, b_k, b_v = (None, None, None) if module.in_proj_bias is None else module.in_proj_bias.chunk(3)
        q, k, v = F.linear(query, w_q, b_q), F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)  # (B, T, E)
    if extra:
        k = torch.cat([k, *(ek.expand(batch, 1, embed) for ek, _ in extra)], dim=1)
        v = torch.cat([v, *(ev.expand(batch, 1, embed) for _, ev in extra)], dim=1)
    return q, k, v, qkv, packed


def _mask(attn_mask: torch.Tensor | None, kpm: torch.Tensor | None, dtype: torch.dtype, appended: int, batch: int,
          heads: int, length: int, total: int) -> torch.Tensor | None:
    """The additive mask, broadcastable to (B, H, L, S'), from ``attn_mask`` and ``key_padding_mask`` (padded for
    the ``appended`` tokens); None without either."""
    mask = None
    attn_mask = _additive(attn_mask, dtype)
    if attn_mask is not None:
        attn_mask = F.pad(attn_mask, (0, appended))
        mask = attn_mask if attn_mask.dim() == 2 else attn_mask.view(batch, heads, length, total)
    kpm = _additive(kpm, dtype)
    if kpm is not None:
        kpm = F.pad(kpm, (0, appended)).view(batch, 1, 1, total)
        mask = kpm if mask is None else mask + kpm
    return mask


def capture_attention(module: nn.MultiheadAttention, args: tuple, kwargs: dict
                      ) -> tuple[tuple[torch.Tensor, torch.Tensor | None], Captured] | None:
    """The layer's forward on ``(args, kwargs)``: ``((attn_output, attn_weights or None), Captured)``, with
    ``Captured.internals`` the in-projection outputs, ``[qkv (B, L, 3E)]`` or ``[q (B, L, E), k (B, S', E),
    v (B, S', E)]`` (k and v with the appended tokens). None where the layer's own forward must run (unbatched
    input, dropout in training, is_causal without a mask, which the layer refuses itself)."""
    query, key, value, kpm, need_weights, attn_mask, average, is_causal = bind(module, args, kwargs)
    if query.dim() != 3 or (module.training and module.dropout > 0) or (is_causal and attn_mask is None):
        return None
    self_attention = _same(query, key) and _same(key, value)
    if not module.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    batch, length, embed = query.shape
    source = key.shape[1]
    heads, dim = module.num_heads, module.head_dim
    dtype = query.dtype

    extra = _appended(module, query, embed)
    q, k, v, qkv, packed = _projections(module, query, key, value, self_attention, extra, batch, embed)
    packed = packed and not extra
    internals = [qkv] if packed else [q, k, v]
    total = source + len(extra)

    qh = q.reshape(batch, length, heads, dim).transpose(1, 2)  # (B, H, L, d)
    kh = k.reshape(batch, total, heads, dim).transpose(1, 2)  # (B, H, S', d)
    vh = v.reshape(batch, total, heads, dim).transpose(1, 2)

    causal = bool(is_causal) and kpm is None and not need_weights  # the is_causal hint wins over attn_mask
    mask = None if causal else _mask(attn_mask, kpm, dtype, len(extra), batch, heads, length, total)

    weights = None
    if need_weights:
        scores = torch.matmul(qh * (1.0 / math.sqrt(dim)), kh.transpose(-1, -2))  # (B, H, L, S')
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        heads_out = torch.matmul(probs, vh)
        weights = probs.mean(1) if average else probs
    else:
        heads_out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal)
    merged = heads_out.transpose(1, 2).reshape(batch, length, embed)  # (B, L, E), the rows the rules read
    # handed downstream in the layer's own layout, (L, B, E) in memory ((B, L, E) a view of it where batch_first), so
    # that what follows (a dropout's mask) meets the samples in the same order; the (B, L, E) product let go at once
    out = F.linear(merged, module.out_proj.weight, module.out_proj.bias).transpose(0, 1).contiguous()
    if module.batch_first:
        out = out.transpose(0, 1)
    return (out, weights), Captured(internals, _State(merged.detach(), packed, source))


@register_call(nn.MultiheadAttention, supports=_supports, capture=capture_attention)
def multihead_attention(module: nn.Module, inputs: tuple, grad_outputs: list, out: dict[str, torch.Tensor],
                        captured: Captured | None = None, captured_grads: list | None = None) -> None:
    """inputs ``(query, key, value, ...)``: query (B, L, E) or (L, B, E), key (B, S, kdim), value (B, S, vdim) (or
    sequence first); grad_outputs ``[attn_output (N, *attn_output.shape)(, attn_weights)]``; ``captured`` from
    :func:`capture_attention` and ``captured_grads`` the (N, *internal.shape) gradients of its internals."""
    if captured is None:
        raise NotImplementedError("a MultiheadAttention call that its capturing forward did not run")
    if not out:
        return
    state: _State = captured.state
    query, key, value = (t if module.batch_first else t.transpose(0, 1) for t in inputs[:3])  # (B, T, *)
    n = next(iter(out.values())).shape[0]
    g = grad_outputs[0]
    with torch.no_grad():
        if g is None:
            g = state.merged.new_zeros(n, *state.merged.shape)
        elif not module.batch_first:
            g = g.transpose(1, 2)  # (N, B, L, E)
        if "out_proj.weight" in out:
            token_outer_sum(g, state.merged, out["out_proj.weight"])
        if "out_proj.bias" in out:
            torch.sum(g, dim=2, out=out["out_proj.bias"])
        grads = [t.new_zeros(n, *t.shape) if d is None else d
                 for t, d in zip(captured.internals, captured_grads, strict=True)]
        _in_projection(module, state, query, key, value, grads, out)


def _in_projection(module: nn.Module, state: _State, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   grads: list[torch.Tensor], out: dict[str, torch.Tensor]) -> None:
    """The in-projection's (and bias_k / bias_v's) per-sample gradients from the gradients of its outputs."""
    w_in, b_in = out.get("in_proj_weight"), out.get("in_proj_bias")
    if state.packed:  # one (N, B, L, 3E) gradient, one matmul
        (d_qkv,) = grads
        if w_in is not None:
            token_outer_sum(d_qkv, query, w_in)
        if b_in is not None:
            torch.sum(d_qkv, dim=2, out=b_in)
        return
    dq, dk, dv = grads  # (N, B, L, E), (N, B, S', E), (N, B, S', E)
    source = state.source
    if "bias_k" in out:
        out["bias_k"].copy_(dk[:, :, source].reshape(out["bias_k"].shape))
    if "bias_v" in out:
        out["bias_v"].copy_(dv[:, :, source].reshape(out["bias_v"].shape))
    embed = dq.shape[-1]
    parts = (("q_proj_weight", dq, query), ("k_proj_weight", dk[:, :, :source], key),
             ("v_proj_weight", dv[:, :, :source], value))
    for j, (name, d, tokens) in enumerate(parts):
        rows = slice(j * embed, (j + 1) * embed)
        w = out.get(name) if w_in is None else w_in[:, :, rows]
        if w is not None:
            token_outer_sum(d, tokens, w)
        if b_in is not None:
            torch.sum(d, dim=2, out=b_in[:, :, rows])


@register_linear_views(nn.MultiheadAttention)
def attention_linear_views(module: nn.Module, inputs: tuple[tuple, dict], grad_outputs: list,
                           captured: Captured | None, captured_grads: list) -> list | None:
    """Packed self-attention (one (B, L, 3E) in-projection): the out-projection on the merged heads (B, L, E) with
    the output gradient, and the in-projection on the query (B, L, E) with the gradient of q, k, v (B, L, 3E). None
    otherwise (separate q / k / v projections, appended tokens: the call rule's per-sample gradients)."""
    if captured is None or not captured.state.packed or not grad_outputs or grad_outputs[0] is None \
            or captured_grads[0] is None:
        return None
    query = bind(module, *inputs)[0]
    g = grad_outputs[0][0]
    if not module.batch_first:
        query, g = query.transpose(0, 1), g.transpose(0, 1)
    return [(captured.state.merged, g, {"weight": "out_proj.weight", "bias": "out_proj.bias"}),
            (query, captured_grads[0][0], {"weight": "in_proj_weight", "bias": "in_proj_bias"})]
