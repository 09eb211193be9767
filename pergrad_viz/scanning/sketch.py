"""Seeded random projections ("sketches") of per-sample gradients that follow the layers' structure.

Shapes: B samples, T positions a layer sees per sample, P trainable scalars, K = ``proj_dim`` columns.

The per-sample gradient (B, P) is cut into **blocks**, one per module that owns trainable parameters (in
``named_modules()`` order; a parameter shared by two modules belongs to the first, as in
``named_parameters()``). Each block b gets k_b of the K output columns and is projected on its own; the
sketch is the concatenation of the blocks' projections, in block order::

    sketch(G_i) = [ G_i[block 1] @ M_1 | G_i[block 2] @ M_2 | ... ]          (B, K), K = sum_b k_b

Three kinds of block:

* **kronecker** (``nn.Linear`` blocks, LoGra-style): the layer's gradient with the bias as an extra column,
  G' = [dW | db] of shape (out, in') with in' = in + 1 (in' = in without a trainable bias), is a sum over
  positions of outer products g_t a'_t^T with a'_t = [a_t, 1]. Two seeded Gaussian matrices
  R_out (out, k_out) and R_in (in', k_in), entries N(0, 1/k_out) and N(0, 1/k_in), give::

      proj = vec(R_out^T G' R_in) = sum_t (R_out^T g_t) (x) (R_in^T a'_t)        (k_out * k_in,)

  so the (out, in) gradient is never formed: the layer input (B, T, in) and the output gradient
  (B, T, out) are projected separately and multiplied (the bias enters through g's projection times the
  last row of R_in). The equivalent dense matrix is M = kron(R_out, R_in) with rows ordered like
  ``[weight.flatten(), bias]`` (row p * in + q for W[p, q], then row out * in + p for b[p]).
* **dense** (every other layer: convolutions, norms, embeddings, ...): the block's flattened per-sample
  gradient (B, P_b), parameters in ``named_parameters()`` order, times a seeded (P_b, k_b) Gaussian matrix
  with entries N(0, 1/k_b).
* **exact**: a block with no more scalars than its share of the columns is copied unprojected (M = I).

Since E[M M^T] = I for every block (E[R R^T] = I for each factor, and kron(A, B) kron(A, B)^T =
kron(A A^T, B B^T)), dot products of sketches are unbiased estimates of the dot products of the true
per-sample gradients: E[sketch(G_i) . sketch(G_j)] = G_i . G_j.

**How the K columns are shared out** (deterministic): water-filling over the blocks' sizes P_b. While
some block has P_b at most an equal share of the columns left, those blocks are kept whole and take P_b
(a whole non-Linear block is "exact"; a whole Linear block is a kronecker block with identity factors);
the others split what is left equally (the first ones get one more when it does not divide). A kronecker
block with share s takes the (k_out, k_in) with k_out <= out, k_in <= in', k_out * k_in <= s that
minimises c = [k_out < out] / k_out + [k_in < in'] / k_in (to first order the relative variance of a
sketched dot product of two rank-one gradients; a factor kept whole, drawn as the identity, adds none);
what it leaves unused passes to the next block. Kronecker blocks are served first and dense blocks absorb
the rest, so the total is exactly K; a model without dense blocks has its last two kronecker blocks chosen
together, with products adding up to what is left, minimising the sum of their c, the first of the two within
its share where possible (if no split exists within the layers' sizes, the last block takes the divisor pair
of its columns that over-projects least).

**Seeding**: one CPU ``torch.Generator`` seeded with ``seed`` draws the matrices in block order (R_out
then R_in for kronecker blocks) in float64, then they are cast to the model's dtype and moved to its
device, so every process and every device draws the same projection.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from pergrad_viz.core.numbers import whole_number
from pergrad_viz.core.ownership import first_owners
from pergrad_viz.core.trainable import Trainable

__all__ = ["Block", "BlockSketch", "GradientSketch", "layer_blocks"]


@dataclass(frozen=True)
class Block:
    """A module's own trainable parameters: one block of the flat per-sample gradient."""

    module: str  # module name; "" for the model itself
    params: tuple[str, ...]  # full parameter names, named_parameters() order
    locals: tuple[str, ...]  # the same parameters' names inside the module
    shapes: tuple[tuple[int, ...], ...]
    linear: tuple[int, int, bool] | None  # (out_features, in_features, has_bias) for an nn.Linear block

    @property
    def size(self) -> int:
        """P_b, the block's number of scalars."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def label(self) -> str:
        return self.module or "(model)"


def layer_blocks(model: nn.Module | Trainable) -> list[Block]:
    """The model's blocks: per module that owns trainable parameters (first owner of a shared one)."""
    trainable = model if isinstance(model, Trainable) else Trainable.of(model)
    full = {id(p): n for n, p in zip(trainable.names, trainable.params, strict=True)}
    blocks = []
    for mname, module, own in first_owners(trainable):
        locs = tuple(ln for ln, _ in own)
        linear = None
        if isinstance(module, nn.Linear) and "weight" in locs and set(locs) <= {"weight", "bias"}:
            linear = (module.out_features, module.in_features, "bias" in locs)
            own.sort(key=lambda item: item[0] != "weight")  # weight first, then bias
            locs = tuple(ln for ln, _ in own)
        blocks.append(Block(mname, tuple(full[id(p)] for _, p in own), locs, tuple(tuple(p.shape) for _, p in own),
                            linear))
    return blocks


@dataclass(frozen=True)
class BlockSketch:
    """How one block is projected: ``kind`` in {"kronecker", "dense", "exact"}, ``dim`` = k_b columns."""

    block: Block
    kind: str
    dim: int
    k_out: int = 0
    k_in: int = 0

    def describe(self) -> dict:
        d = {"module": self.block.label, "params": list(self.block.params), "size": self.block.size,
             "kind": self.kind, "dim": self.dim}
        if self.kind == "kronecker":
            d.update(k_out=self.k_out, k_in=self.k_in)
        return d


def _cost(k_out: int, k_in: int, out: int, inp: int) -> float:
    """To first order, the relative variance of a sketched dot product of two rank-one gradients: 1/k per
    projected factor (a factor kept whole, k = its size, is exact and adds nothing)."""
    return (k_out < out) / k_out + (k_in < inp) / k_in


def _pairs(out: int, inp: int, limit: int) -> dict[int, tuple[float, int, int]]:
    """For every product p <= limit reachable with k_out <= out, k_in <= inp: the cheapest (cost, k_out, k_in)."""
    best: dict[int, tuple[float, int, int]] = {}
    for k_out in range(1, min(out, limit) + 1):
        for k_in in range(1, min(inp, limit // k_out) + 1):
            p, c = k_out * k_in, _cost(k_out, k_in, out, inp)
            if p not in best or c < best[p][0]:
                best[p] = (c, k_out, k_in)
    return best


def _over_pair(total: int, out: int, inp: int) -> tuple[int, int]:
    """Last resort when no (k_out <= out, k_in <= inp) has product ``total``: the divisor pair of ``total`` that
    over-projects least (still unbiased, only wasteful)."""
    pairs = [(k, total // k) for k in range(1, total + 1) if total % k == 0]
    return min(pairs, key=lambda p: (max(p[0] / out, 1) * max(p[1] / inp, 1), 1 / p[0] + 1 / p[1]))


def _linear_dims(block: Block) -> tuple[int, int]:
    out, inp, bias = block.linear
    return out, inp + bias


def allocate(blocks: list[Block], proj_dim: int) -> list[BlockSketch]:
    """Share ``proj_dim`` columns among ``blocks`` (water-filling, then kronecker pairs); see the module doc."""
    total = sum(b.size for b in blocks)
    if proj_dim < len(blocks) or proj_dim > total:
        raise ValueError(
            f"proj_dim={proj_dim} must lie between the number of layers with trainable parameters ({len(blocks)}) "
            f"and the number of trainable scalars P={total}: pass a proj_dim in [{len(blocks)}, {total}] "
            "(at P the sketch is the gradient itself, so use pv.per_sample_grads for that)"
        )
    whole: set[int] = set()
    left = proj_dim
    while True:
        open_ = [i for i in range(len(blocks)) if i not in whole]
        small = [i for i in open_ if blocks[i].size * len(open_) <= left]
        if not small:
            break
        whole.update(small)
        left -= sum(blocks[i].size for i in small)
    open_ = [i for i in range(len(blocks)) if i not in whole]
    shares = {i: left // len(open_) + (r < left % len(open_)) for r, i in enumerate(open_)}
    shares.update({i: blocks[i].size for i in whole})
    result: dict[int, BlockSketch] = {}
    for i in whole:
        if blocks[i].linear is None:
            result[i] = BlockSketch(blocks[i], "exact", blocks[i].size)
    kron = [i for i in range(len(blocks)) if blocks[i].linear is not None]  # whole Linear blocks too: (out, in')
    dense = [i for i in open_ if blocks[i].linear is None]
    # Kronecker blocks in order, each the cheapest pair within its share (+ what earlier ones left); dense
    # blocks absorb the rest exactly. Without dense blocks the last two kronecker blocks are chosen jointly so
    # that the total is exact.
    joint = [] if dense else kron[-2:]
    carry = 0
    for i in kron:
        if i in joint:
            carry += shares[i]
            continue
        out, inp = _linear_dims(blocks[i])
        share = shares[i] + carry
        _, k_out, k_in = min(c for p, c in _pairs(out, inp, share).items())
        result[i] = BlockSketch(blocks[i], "kronecker", k_out * k_in, k_out, k_in)
        carry = share - k_out * k_in
    if joint:
        cap = shares[joint[0]] + carry - sum(shares[i] for i in joint[1:])  # the first one's share, if it can
        for i, (k_out, k_in) in zip(joint, _joint_pairs([blocks[i] for i in joint], carry, cap), strict=True):
            result[i] = BlockSketch(blocks[i], "kronecker", k_out * k_in, k_out, k_in)
        carry = 0
    for r, i in enumerate(dense):
        result[i] = BlockSketch(blocks[i], "dense", shares[i] + (carry if r == 0 else 0))
    return [result[i] for i in range(len(blocks))]


def _joint_pairs(blocks: list[Block], total: int, cap: int) -> list[tuple[int, int]]:
    """(k_out, k_in) for one or two kronecker blocks whose products add up to exactly ``total``, the cheapest
    (sum of costs) with the first block's product at most ``cap`` (its share) if possible, else any."""
    dims = [_linear_dims(b) for b in blocks]
    options = [_pairs(out, inp, total) for out, inp in dims]
    if len(blocks) == 1:
        if total in options[0]:
            return [options[0][total][1:]]
        return [_over_pair(total, *dims[0])]
    a, b = options
    splits = [(a[p][0] + b[total - p][0], p) for p in a if total - p in b]
    best = min((sp for sp in splits if sp[1] <= cap), default=None) or min(splits, default=None)
    if best is not None:
        p = best[1]
        return [a[p][1:], b[total - p][1:]]
    p = max(a)  # no exact split within the layers' sizes: the second block over-projects
    return [a[p][1:], _over_pair(total - p, *dims[1])]


class GradientSketch:
    """A seeded structured projection of flat per-sample gradients (B, P) to (B, proj_dim).

    >>> sk = GradientSketch(model, proj_dim=256, seed=0)
    >>> sk.project_grads(pv.per_sample_grads(model, loss_fn, x, y))    # (B, 256)
    >>> sk.dense_matrix()                                              # (P, 256): the same map, explicitly

    Attributes:
        blocks: one :class:`BlockSketch` per block, in output-column order.
        offsets: the first output column of each block.
        matrices: per block, ``(R_out (out, k_out), R_in (in', k_in))`` for kronecker blocks,
            ``(R (P_b, k_b),)`` for dense ones, ``()`` for exact ones.
    """

    def __init__(self, model: nn.Module | Trainable, proj_dim: int, seed: int = 0):
        trainable = model if isinstance(model, Trainable) else Trainable.of(model)
        if isinstance(proj_dim, bool) or not isinstance(proj_dim, int):
            proj_dim = whole_number("proj_dim", proj_dim, hint=" (columns of the sketch)")
        self.proj_dim = proj_dim
        self.seed = whole_number("seed", seed, minimum=0)
        self.param_order = list(trainable.names)  # rows of dense_matrix(), columns of a flat (B, P)
        self.dtype, self.device = trainable.dtype, trainable.device
        self.blocks = allocate(layer_blocks(trainable), proj_dim)
        self.offsets = [0]
        for bs in self.blocks:
            self.offsets.append(self.offsets[-1] + bs.dim)
        self.offsets.pop()
        gen = torch.Generator(device="cpu").manual_seed(seed)
        kw = {"dtype": trainable.dtype, "device": trainable.device}

        def gauss(rows: int, cols: int) -> torch.Tensor:
            r = torch.randn(rows, cols, generator=gen, dtype=torch.float64) / math.sqrt(cols)
            return r.to(**kw)

        def factor(rows: int, cols: int) -> torch.Tensor:  # a kronecker factor: kept whole when cols == rows
            return torch.eye(rows, **kw) if cols == rows else gauss(rows, cols)

        self.matrices: list[tuple[torch.Tensor, ...]] = []
        for bs in self.blocks:
            if bs.kind == "kronecker":
                out, inp, bias = bs.block.linear
                self.matrices.append((factor(out, bs.k_out), factor(inp + bias, bs.k_in)))
            elif bs.kind == "dense":
                self.matrices.append((gauss(bs.block.size, bs.dim),))
            else:
                self.matrices.append(())
        self.by_module = {bs.block.module: i for i, bs in enumerate(self.blocks)}

    def describe(self) -> list[dict]:
        """The layout, as plain data (stored in a scan's manifest)."""
        return [{**bs.describe(), "offset": off} for bs, off in zip(self.blocks, self.offsets, strict=True)]

    def project_linear(self, index: int, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """A kronecker block's sketch from the layer's input ``a`` (B, T, in) and output gradient ``g``
        (B, T, out), summed over the T positions: (B, k_out * k_in). Never forms the (B, out, in) gradient."""
        bs = self.blocks[index]
        r_out, r_in = self.matrices[index]
        _, inp, bias = bs.block.linear
        pa = a @ r_in[:inp]  # (B, T, k_in)
        if bias:
            pa = pa + r_in[inp]
        pg = g @ r_out  # (B, T, k_out)
        if pa.shape[1] == 1:
            return (pg[:, 0, :, None] * pa[:, 0, None, :]).flatten(1)
        return torch.bmm(pg.mT, pa).flatten(1)

    def project_block(self, index: int, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One block's sketch from its materialised per-sample gradients {full name: (B, *param.shape)}:
        (B, k_b)."""
        bs = self.blocks[index]
        block = bs.block
        if bs.kind == "kronecker":
            r_out, r_in = self.matrices[index]
            w = grads[block.params[0]]  # (B, out, in)
            if block.linear[2]:
                w = torch.cat([w, grads[block.params[1]].unsqueeze(-1)], dim=-1)  # (B, out, in + 1)
            return (r_out.mT @ w @ r_in).flatten(1)
        flat = torch.cat([grads[n].reshape(grads[n].shape[0], -1) for n in block.params], dim=1)  # (B, P_b); 0-dim too
        return flat if bs.kind == "exact" else flat @ self.matrices[index][0]

    def project_grads(self, grads: Mapping[str, torch.Tensor] | torch.Tensor) -> torch.Tensor:
        """Sketch of materialised per-sample gradients: a dict {name: (B, *shape)} as
        :func:`pergrad_viz.per_sample_grads` returns, or its flat (B, P) form; returns (B, proj_dim)."""
        if isinstance(grads, torch.Tensor):
            grads = self._split_flat(grads)
        return torch.cat([self.project_block(i, grads) for i in range(len(self.blocks))], dim=1)

    def _split_flat(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, P) in named_parameters() order -> {name: (B, *shape)}."""
        shapes = {}
        for bs in self.blocks:
            shapes.update(zip(bs.block.params, bs.block.shapes, strict=True))
        out, offset = {}, 0
        for name in self.param_order:
            n = math.prod(shapes[name])
            out[name] = flat[:, offset:offset + n].reshape(flat.shape[0], *shapes[name])
            offset += n
        if offset != flat.shape[1]:
            raise ValueError(f"flat gradients have {flat.shape[1]} columns, the model has P={offset}")
        return out

    def dense_matrix(self) -> torch.Tensor:
        """The whole sketch as one explicit (P, proj_dim) matrix M (rows in named_parameters() order), so that
        ``sketch = G_flat @ M``. For checks and small models only: it is P x K."""
        rows = {}
        for i, bs in enumerate(self.blocks):
            cols = slice(self.offsets[i], self.offsets[i] + bs.dim)
            m = self._block_matrix(i)
            start = 0
            for name, shape in zip(bs.block.params, bs.block.shapes, strict=True):
                n = math.prod(shape)
                rows[name] = (cols, m[start:start + n])
                start += n
        p = sum(v[1].shape[0] for v in rows.values())
        dense = torch.zeros(p, self.proj_dim, dtype=self.dtype, device=self.device)
        offset = 0
        for name in self.param_order:
            cols, m = rows[name]
            dense[offset:offset + m.shape[0], cols] = m
            offset += m.shape[0]
        return dense

    def _block_matrix(self, index: int) -> torch.Tensor:
        bs = self.blocks[index]
        if bs.kind == "exact":
            return torch.eye(bs.block.size, dtype=self.dtype, device=self.device)
        if bs.kind == "dense":
            return self.matrices[index][0]
        r_out, r_in = self.matrices[index]
        _, inp, bias = bs.block.linear
        weight = torch.kron(r_out, r_in[:inp])  # row p * in + q  <->  W[p, q]
        if not bias:
            return weight
        return torch.cat([weight, torch.kron(r_out, r_in[inp:])], dim=0)  # then row out * in + p <-> b[p]
