"""nn.RNN (tanh, relu), nn.LSTM and nn.GRU: any number of layers, bidirectional or not, with or without biases
and initial states, on batched input (B, T, in) (batch_first) or (T, B, in); proj_size 0 only.

The rule replays the recurrence with the layer's weights (one forward over the B samples), then runs
backpropagation through time by hand, batched over the N output gradients, which gives the gradient of every
gate pre-activation at every step. Each weight is a Linear applied at every step, so its per-sample gradient
is a sum over time of outer products::

    dW_ih = sum_t outer(dgates_ih[t], x[t])      db_ih = sum_t dgates_ih[t]
    dW_hh = sum_t outer(dgates_hh[t], h[t - 1])  db_hh = sum_t dgates_hh[t]

``dgates_hh`` equals ``dgates_ih`` except for GRU's candidate gate n = tanh(W_in x + b_in + r * (W_hn h + b_hn)),
whose hidden part is scaled by r.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from pergrad_viz.rules.registry import register_call


@dataclass
class _Pass:
    """What one direction of one layer saw, in its processing order (reversed in time for the reverse one)."""

    x: torch.Tensor  # (B, T, in)
    h_prev: torch.Tensor  # (B, T, H): the state before each step (h0 first)
    h: torch.Tensor  # (B, T, H): the state after each step
    saved: list  # per step: gate values the backward needs (LSTM, GRU)


@register_call(nn.RNN, nn.LSTM, nn.GRU, supports=lambda m: m.proj_size == 0 if isinstance(m, nn.LSTM) else True)
def recurrent(module: nn.Module, inputs: tuple, grad_outputs: list, out: dict[str, torch.Tensor]) -> None:
    """inputs ``(x,)`` or ``(x, hx)``: x (B, T, in) or (T, B, in), hx (L * D, B, H) (LSTM: a pair (h0, c0));
    grad_outputs ``[output (N, *x.shape[:2], D * H), h_n (N, L * D, B, H)]`` and, for LSTM, c_n alike."""
    x = inputs[0]
    hx = inputs[1] if len(inputs) > 1 else None
    if isinstance(x, PackedSequence):
        raise NotImplementedError(f"{type(module).__name__} on a PackedSequence")
    if getattr(module, "proj_size", 0) > 0:
        raise NotImplementedError(f"{type(module).__name__} with proj_size > 0")
    if x.dim() != 3:
        raise NotImplementedError(f"{type(module).__name__} on unbatched input of shape {tuple(x.shape)}")
    if module.training and module.dropout > 0 and module.num_layers > 1:
        raise NotImplementedError(f"{type(module).__name__} with dropout between layers in training mode")
    with torch.no_grad():
        _recurrent(module, x, hx, grad_outputs, out)


def _recurrent(module: nn.Module, x: torch.Tensor, hx, grad_outputs: list, out: dict[str, torch.Tensor]) -> None:
    mode, layers, hidden = module.mode, module.num_layers, module.hidden_size
    dirs = 2 if module.bidirectional else 1
    if not module.batch_first:
        x = x.transpose(0, 1)  # (B, T, in)
    batch = x.shape[0]
    given = [g for g in grad_outputs if g is not None]
    n = given[0].shape[0] if given else 1
    d_out, d_hn = grad_outputs[0], grad_outputs[1]
    d_cn = grad_outputs[2] if mode == "LSTM" else None
    if d_out is not None and not module.batch_first:
        d_out = d_out.transpose(1, 2)  # (N, B, T, D * H)
    h0, c0 = (hx if mode == "LSTM" else (hx, None)) if hx is not None else (None, None)
    zeros = x.new_zeros(batch, hidden)

    needed = [k for k in range(layers) if any(name in out for name in _names(k))]
    if not needed:
        return
    if not given:
        for t in out.values():
            t.zero_()
        return

    passes: list[list[_Pass]] = []  # [layer][direction]
    inp = x
    for k in range(layers):
        row = []
        for d in range(dirs):
            j = k * dirs + d
            w_ih, w_hh, b_ih, b_hh = _weights(module, k, d)
            seq = inp.flip(1) if d else inp
            h_init = zeros if h0 is None else h0[j]
            c_init = zeros if c0 is None else c0[j]
            row.append(_forward(mode, seq, h_init, c_init, w_ih, w_hh, b_ih, b_hh))
        passes.append(row)
        inp = torch.cat([p.h.flip(1) if d else p.h for d, p in enumerate(row)], dim=-1)  # (B, T, D * H)

    for k in reversed(range(needed[0], layers)):
        d_in = None  # (N, B, T, in): the gradient with respect to this layer's input
        for d in range(dirs):
            j = k * dirs + d
            w_ih, w_hh, _, _ = _weights(module, k, d)
            p = passes[k][d]
            dh_seq = None if d_out is None else d_out[..., d * hidden:(d + 1) * hidden]
            if dh_seq is not None and d:
                dh_seq = dh_seq.flip(2)
            dh_last = None if d_hn is None else d_hn[:, j]
            dc_last = None if d_cn is None else d_cn[:, j]
            dgi, dgh = _backward(mode, p, w_hh, dh_seq, dh_last, dc_last, n)
            _write(out, k, d, dgi, dgh, p)
            if k > needed[0]:
                dx = torch.matmul(dgi, w_ih)  # (N, B, T, in), processing order
                dx = dx.flip(2) if d else dx
                d_in = dx if d_in is None else d_in + dx
        d_out = d_in


def _names(k: int) -> list[str]:
    """Parameter names of layer k, both directions (those a layer does not have never appear in ``out``)."""
    return [f"{kind}_{part}_l{k}{s}" for s in ("", "_reverse") for kind in ("weight", "bias") for part in ("ih", "hh")]


def _weights(module: nn.Module, k: int, d: int) -> tuple:
    s = f"l{k}_reverse" if d else f"l{k}"
    return (getattr(module, f"weight_ih_{s}"), getattr(module, f"weight_hh_{s}"),
            getattr(module, f"bias_ih_{s}", None), getattr(module, f"bias_hh_{s}", None))


def _forward(mode: str, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor,
             b_ih: torch.Tensor | None, b_hh: torch.Tensor | None) -> _Pass:
    """One direction of one layer over x (B, T, in) from h, c (B, H), in processing order."""
    gi = F.linear(x, w_ih, b_ih)  # (B, T, G * H): the input parts of all steps at once
    states, saved = [h], []
    for t in range(x.shape[1]):
        gh = F.linear(h, w_hh, b_hh)  # (B, G * H)
        if mode == "LSTM":
            i, f, g, o = (gi[:, t] + gh).chunk(4, dim=-1)
            i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
            c_prev, c = c, f * c + i * g
            tanh_c = torch.tanh(c)
            h = o * tanh_c
            saved.append((i, f, g, o, c_prev, tanh_c))
        elif mode == "GRU":
            r_i, z_i, n_i = gi[:, t].chunk(3, dim=-1)
            r_h, z_h, n_h = gh.chunk(3, dim=-1)
            r, z = torch.sigmoid(r_i + r_h), torch.sigmoid(z_i + z_h)
            cand = torch.tanh(n_i + r * n_h)
            h = (1 - z) * cand + z * h
            saved.append((r, z, cand, n_h))
        elif mode == "RNN_TANH":
            h = torch.tanh(gi[:, t] + gh)
        else:
            h = torch.relu(gi[:, t] + gh)
        states.append(h)
    hs = torch.stack(states, dim=1)  # (B, T + 1, H)
    return _Pass(x, hs[:, :-1], hs[:, 1:], saved)


def _backward(mode: str, p: _Pass, w_hh: torch.Tensor, dh_seq: torch.Tensor | None, dh_last: torch.Tensor | None,
              dc_last: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Backpropagation through time of one direction of one layer, in its processing order.

    dh_seq (N, B, T, H): gradients with respect to the states it outputs; dh_last, dc_last (N, B, H): with
    respect to its final states. Returns the gate pre-activation gradients (N, B, T, G * H) of the input part
    and of the hidden part (the same tensor except for GRU).
    """
    batch, steps, hidden = p.h.shape
    dh = p.h.new_zeros(n, batch, hidden) if dh_last is None else dh_last
    dc = p.h.new_zeros(n, batch, hidden) if dc_last is None else dc_last
    d_ih, d_hh = [], []
    for t in reversed(range(steps)):
        g = dh if dh_seq is None else dh + dh_seq[:, :, t]  # (N, B, H): total gradient of state t
        if mode == "LSTM":
            i, f, gg, o, c_prev, tanh_c = p.saved[t]
            dc = dc + g * o * (1 - tanh_c * tanh_c)
            pre = torch.cat([dc * gg * i * (1 - i), dc * c_prev * f * (1 - f), dc * i * (1 - gg * gg),
                             g * tanh_c * o * (1 - o)], dim=-1)
            dc = dc * f
            d_ih.append(pre)
            dh = torch.matmul(pre, w_hh)
        elif mode == "GRU":
            r, z, cand, n_h = p.saved[t]
            dn = g * (1 - z) * (1 - cand * cand)
            dz = g * (p.h_prev[:, t] - cand) * z * (1 - z)
            dr = dn * n_h * r * (1 - r)
            d_ih.append(torch.cat([dr, dz, dn], dim=-1))
            d_hh.append(torch.cat([dr, dz, dn * r], dim=-1))
            dh = g * z + torch.matmul(d_hh[-1], w_hh)
        else:
            h = p.h[:, t]
            pre = g * (1 - h * h) if mode == "RNN_TANH" else g * (h > 0).to(g.dtype)
            d_ih.append(pre)
            dh = torch.matmul(pre, w_hh)
    dgi = torch.stack(d_ih[::-1], dim=2)  # (N, B, T, G * H)
    dgh = torch.stack(d_hh[::-1], dim=2) if d_hh else dgi
    return dgi, dgh


def _write(out: dict[str, torch.Tensor], k: int, d: int, dgi: torch.Tensor, dgh: torch.Tensor, p: _Pass) -> None:
    """Sums over time of outer products into out's (N, B, *param.shape) entries of layer k, direction d."""
    s = f"l{k}_reverse" if d else f"l{k}"
    if f"weight_ih_{s}" in out:
        out[f"weight_ih_{s}"].copy_(torch.matmul(dgi.transpose(-1, -2), p.x))  # (N, B, G * H, in)
    if f"weight_hh_{s}" in out:
        out[f"weight_hh_{s}"].copy_(torch.matmul(dgh.transpose(-1, -2), p.h_prev))  # (N, B, G * H, H)
    if f"bias_ih_{s}" in out:
        torch.sum(dgi, dim=2, out=out[f"bias_ih_{s}"])
    if f"bias_hh_{s}" in out:
        torch.sum(dgh, dim=2, out=out[f"bias_hh_{s}"])
