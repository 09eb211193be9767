"""The clipped sum's tensors, {name: (*shape)}: made as the layers' shares ask for them (noise drawn in parameter
order all the same), and without noise handed out unwritten to a writer that fills them
(``pergrad_viz.rules.register_weighted_sum(..., writes_fresh=True)``)."""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping

import torch

from pergrad_viz.core.layout import sample_rows
from pergrad_viz.rules import writes_fresh


class LazySums(dict):
    """{name: (*shape)}: the tensors the clipped gradients are added into, each made when first asked for: ``std *
    N(0, I)`` drawn in place (``normal_``, from ``generator`` alone, always in parameter order: asking for a later
    parameter draws the earlier ones first, so the draws are the same whatever order the layers ask in), or zeros
    for ``std=0``. The layers' shares come bottom layer first, as a backward has let their activations go, so the
    sums are not all held beside every layer's captures (as plain training's ``.grad`` is made during its
    backward); without noise, :meth:`destination` hands a tensor out unwritten to a writer that fills it."""

    def __init__(self, shapes, std: float, generator: torch.Generator | None):
        super().__init__()
        self._shapes = {name: rest for name, *rest in shapes}  # name -> (shape, dtype, device), in order
        self._todo = collections.deque(self._shapes)  # the names whose noise is not drawn yet, in order
        self._std, self._generator = std, generator

    def __missing__(self, name: str) -> torch.Tensor:
        if name not in self._shapes:
            raise KeyError(name)
        if self._std == 0:
            shape, dtype, device = self._shapes[name]
            t = self[name] = torch.zeros(shape, dtype=dtype, device=device)
            return t
        while self._todo:
            made = self._todo.popleft()
            shape, dtype, device = self._shapes[made]
            self[made] = torch.empty(shape, dtype=dtype, device=device).normal_(0.0, self._std,
                                                                                 generator=self._generator)
            if made == name:
                break
        return self[name]

    def destination(self, name: str) -> tuple[torch.Tensor, bool]:
        """(the tensor of ``name``, whether it is handed out unwritten): without noise, the first time a name is
        asked for here its tensor is allocated and not zeroed, and the caller must write all of it before it is
        read (``addmm_(..., beta=0)``, ``copy_``); every other time it holds values, to be added to."""
        if self._std == 0 and name not in self and name in self._shapes:
            shape, dtype, device = self._shapes[name]
            t = self[name] = torch.empty(shape, dtype=dtype, device=device)
            return t, True
        return self[name], False

    def add_weighted(self, name: str, g: torch.Tensor, c: torch.Tensor) -> None:
        """self[name] (*shape) += sum_i c_i g_i of a (B, *shape) per-sample gradient and c (B,), one ``addmm_`` into
        it (written, not added, where :meth:`destination` hands it out unwritten), in the sum's dtype (a model of
        several dtypes: the per-sample gradients come in one)."""
        dest, fresh = self.destination(name)
        dest.view(1, -1).addmm_(c.to(dest.dtype).unsqueeze(0), sample_rows(g).to(dest.dtype),
                                beta=0 if fresh else 1)

    def add_share(self, rule: Callable, module, seen, weights: dict[str, torch.Tensor],
                  names: Mapping[str, str]) -> None:
        """A weighted-sum rule's share added in (``names``: the rule's local names' full ones): the tensors
        :meth:`destination` hands out unwritten are the rule's to write (``pergrad_viz.rules.writes_fresh``), or
        zeroed first for a rule that only adds."""
        out, fresh = {}, []
        for ln, name in names.items():
            out[ln], new = self.destination(name)
            if new:
                fresh.append(ln)
        if writes_fresh(rule):
            rule(module, seen, weights, out, fresh)
            return
        for ln in fresh:
            out[ln].zero_()
        rule(module, seen, weights, out)

    def complete(self) -> dict[str, torch.Tensor]:
        """Every parameter's tensor made; a plain dict in parameter order."""
        return {name: self[name] for name in self._shapes}


def initial_sums(shapes, std: float, generator: torch.Generator | None) -> dict[str, torch.Tensor]:
    """{name: (*shape)}: every tensor of :class:`LazySums` made at once (noise drawn parameter by parameter in
    order, or zeros); the clipped gradients are then added into these (no temporary)."""
    return LazySums(shapes, std, generator).complete()
