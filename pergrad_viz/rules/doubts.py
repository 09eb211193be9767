"""Gram norms computed as they are, their range read later. Whether a layer's squared norms, a sum of products of
four entries (a Linear's ``sum_{t,s} (a_t . a_s)(g_t . g_s)``, a convolution's), may be computed from unscaled values
is read from each sample's largest Gram diagonal entry (:func:`tops_fit`). On a CPU the rules read it at once (a
read of the host's own memory). On a GPU that read synchronises, so there the rules used to scale every sample of
every layer (some 25 small kernels a layer, each a launch: most of a transformer's DP step on an H200). Now a caller
that can wait (book-keeping, :class:`Doubts`) opens a layer, the rules note the maxima (two kernels) and return the
unscaled norms, and one read for all layers of the call, before any norm is used, finds the rare layer whose values
are extreme: computed again, scaled (:mod:`pergrad_viz.rules.scaling`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

# Where true, a caller opens its layers on a CPU too (tests: the path a GPU takes, checked here).
ON_CPU = False


@dataclass(frozen=True)
class _Note:
    tops: torch.Tensor  # (2, B): per sample, the largest diagonal entry of the left and of the right Gram
    span: int  # the sum's terms per pair of diagonal maxima (T^2 for a Linear on T tokens)
    widths: tuple[int, int]  # the features each Gram entry sums over (left, right)
    dtypes: tuple[torch.dtype, torch.dtype]  # each Gram's own (under autocast a float32 input, a float16 gradient)
    cancelled: torch.Tensor | None = None  # (B,) bool: samples whose terms may cancel (``rules.linear.cancelling``)


_OPEN: ContextVar[list[_Note] | None] = ContextVar("pergrad_viz_open_layer", default=None)


def tops_fit(top_a: list[float], top_g: list[float], dtypes: tuple[torch.dtype, torch.dtype], span: int,
             width_a: int, width_g: int) -> bool:
    """Whether a Gram norm summing ``span`` products of an entry of a left Gram (entries over ``width_a`` features)
    and one of a right Gram (``width_g``), each sample's largest diagonal entries ``top_a`` and ``top_g`` (an entry is
    at most its diagonal's), is as exact unscaled as scaled: every maximum finite (no square overflowed), their
    product and each alone times ``span`` far below the dtype's largest number (no sum can overflow), and each
    sample's maximum 0 or at least ``width`` times ``tiny / eps`` (the terms lost to underflow, at most ``width *
    tiny`` an entry, stay below the sum's own rounding), each Gram in its own dtype (``dtypes``), and each sample's
    product of its two maxima at least ``span`` times ``tiny / eps`` of the dtype the products are summed in."""
    if not all(map(math.isfinite, top_a + top_g)):
        return False
    left, right = torch.finfo(dtypes[0]), torch.finfo(dtypes[1])
    hi_a, hi_g = max(top_a, default=0.0), max(top_g, default=0.0)
    # nor a sum of one Gram's entries alone (a bias's ||sum_t g_t||^2, a convolution's taps summed)
    if max(hi_a * hi_g, hi_a, hi_g) * span > min(left.max, right.max) / 16:
        return False
    # every nonzero entry at least width * tiny / eps (filter(None, ...) drops the zeros; no loop in Python)
    if min(filter(None, top_a), default=math.inf) < width_a * left.tiny / left.eps \
            or min(filter(None, top_g), default=math.inf) < width_g * right.tiny / right.eps:
        return False
    # nor their products (each Gram's entries normal, their product below the range: both 1e-23 in float32 made every
    # term 0; a probe), a sample's both maxima together
    summed = torch.finfo(torch.promote_types(*dtypes))  # the dtype the products are summed in
    low = span * summed.tiny / summed.eps
    # (a sample with a 0 maximum has a norm of 0 either way; a product that is 0 in Python's float64 is no such sample)
    return min((a * g for a, g in zip(top_a, top_g, strict=True) if a and g), default=math.inf) >= low


def deferring(*factors: torch.Tensor) -> bool:
    """Whether a caller has opened a layer, so that the rules may note the Grams' maxima of these ``factors`` instead
    of reading them: not in float16, whose squares underflow below 6e-5 (most layers' gradients would be computed
    twice, unscaled and again scaled)."""
    return _OPEN.get() is not None and all(t.dtype != torch.float16 for t in factors)


def note_grams(left: torch.Tensor, right: torch.Tensor, span: int, width_a: int, width_g: int,
               cancelled: torch.Tensor | None = None) -> None:
    """Note the Grams (B, n, n) and (B, m, m) of the open layer's unscaled factors for :meth:`Doubts.settle`
    (``cancelled``: (B,) the samples whose norm must be computed again whatever the range)."""
    if left.shape == right.shape and left.dtype == right.dtype:  # both diagonals in one reduction (a Linear's)
        tops = torch.stack([left.diagonal(dim1=1, dim2=2), right.diagonal(dim1=1, dim2=2)]).amax(2)
    else:
        tops = torch.stack([gram_tops(left), gram_tops(right)])
    note_tops(tops, span, width_a, width_g, (left.dtype, right.dtype), cancelled)


def gram_tops(gram: torch.Tensor) -> torch.Tensor:
    """(B,) each sample's largest diagonal entry of a Gram (B, n, n)."""
    return gram.diagonal(dim1=1, dim2=2).amax(1)


def note_tops(tops: torch.Tensor, span: int, width_a: int, width_g: int,
              dtypes: tuple[torch.dtype, torch.dtype], cancelled: torch.Tensor | None = None) -> None:
    """Note (2, B) Gram maxima (:func:`gram_tops` of the left and of the right Gram, in ``dtypes``) for the open
    layer."""
    notes = _OPEN.get()
    assert notes is not None, "a note outside an open layer"
    notes.append(_Note(tops, span, (width_a, width_g), dtypes, cancelled))


def doubts_for(device: torch.device) -> Doubts | None:
    """A :class:`Doubts` for a call on ``device`` where reading a Gram's range now would synchronise (not a CPU, but
    with :data:`ON_CPU`), else None: the rules read it at once."""
    return Doubts() if device.type != "cpu" or ON_CPU else None


class Doubts:
    """The layers of one call whose norms were computed unscaled, each with its notes and how to compute it again."""

    def __init__(self) -> None:
        self._layers: list[tuple[list[_Note], Callable[[], None]]] = []

    @contextmanager
    def layer(self, redo: Callable[[], None]) -> Iterator[None]:
        """Inside: the rules may note their Grams for this layer (``redo()``: its norms again, scaled, put where the
        caller keeps them; called by :meth:`settle` where the notes do not fit)."""
        notes: list[_Note] = []
        token = _OPEN.set(notes)
        try:
            yield
        finally:
            _OPEN.reset(token)
        if notes:
            self._layers.append((notes, redo))

    def settle(self) -> int:
        """One host read of every note (per dtype), then each layer whose notes do not fit :func:`tops_fit` computed
        again. Returns how many were."""
        layers, self._layers = self._layers, []
        if not layers:
            return 0
        notes = [n for group, _ in layers for n in group]
        values: dict[int, list[float]] = {}
        for dtype in {n.tops.dtype for n in notes}:
            picked = [k for k, n in enumerate(notes) if n.tops.dtype == dtype]
            # per note its maxima, then whether a sample's terms cancel: the one synchronisation
            flat = torch.cat([torch.cat([notes[k].tops.flatten(), _any(notes[k].cancelled, notes[k].tops)])
                              for k in picked]).tolist()
            at = 0
            for k in picked:
                size = notes[k].tops.numel() + 1
                values[k] = flat[at:at + size]
                at += size
        redone, k = 0, 0
        for group, redo in layers:
            fits = True
            for n in group:
                half = n.tops.shape[1]
                fits = fits and not values[k][-1] and tops_fit(values[k][:half], values[k][half:-1], n.dtypes,
                                                               n.span, *n.widths)
                k += 1
            if not fits:
                redo()
                redone += 1
        return redone


def _any(cancelled: torch.Tensor | None, tops: torch.Tensor) -> torch.Tensor:
    """(1,) as ``tops`` is (dtype, device): 1 where ``cancelled`` (B,) holds a sample, else 0 (and for no such note)."""
    if cancelled is None:
        return tops.new_zeros(1)
    return cancelled.any().to(tops.dtype).reshape(1)
