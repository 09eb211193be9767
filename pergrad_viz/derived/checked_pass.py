"""What a pass that never builds the rows forms beside its result on a call the check will look at, layer by layer
from the same captures (the ghost norms, the scan's norms): ``sum_i w_i g_i`` for random w, and each row's
``g_i . v`` for a random direction v; :func:`pergrad_viz.engine.combination.check_combination` then compares them
with a plain weighted backward and with each sample alone by forward mode. Book-keeping forms the same from its
shares and booked layers (``derived/bookkeeping.py``: :meth:`CheckedPass.weights_for`, :meth:`CheckedPass.add_dots`)."""

from __future__ import annotations

import torch

from pergrad_viz.core.numbers import SQUARES
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.derived.directions import layer_directions
from pergrad_viz.derived.sums import add_layer, zero_sums
from pergrad_viz.engine.capture import Layer
from pergrad_viz.engine.combination import check_direction, combination_weights, keep_combination
from pergrad_viz.engine.grouping import Seen


class CheckedPass:
    """One call's pass over ``batch`` samples: :meth:`begin` after its first capture, :meth:`layer` for each layer of
    each chunk, :meth:`keep` at the end; nothing formed on a call the check will not look at."""

    def __init__(self, trainable: Trainable, batch: int):
        self.trainable, self.batch = trainable, batch
        self.direction = check_direction(trainable)  # known before the pass: the schedule's verdict
        self.dots = None if self.direction is None else {
            n: torch.zeros(batch, dtype=SQUARES, device=trainable.device) for n in trainable.names}
        self.weights = self.combined = None

    def begin(self) -> None:
        """After the first capture (a graph no check saw makes the call checked too)."""
        self.weights = combination_weights(self.trainable, self.batch)
        self.combined = None if self.weights is None else zero_sums(self.trainable)

    def layer(self, layer: Layer, seen: Seen, rows: slice) -> None:
        """One layer's part, from its calls on the samples ``rows`` (``seen``: N = 1)."""
        if self.combined is not None:
            add_layer(self.combined, layer, seen, self.weights[rows].to(self.trainable.dtype))
        if self.dots is not None:
            self.add_dots(layer_directions(layer, seen, self.direction), rows)

    def add_dots(self, dots: dict[str, torch.Tensor], rows: slice) -> None:
        """{name: (rows,) g_i . v} formed elsewhere (book-keeping's layers) added in."""
        for name, d in dots.items():
            self.dots[name][rows] += d

    def weights_for(self, rows: slice) -> dict[str, torch.Tensor] | None:
        """{name: the weights w of the samples ``rows``} for a weighted sum of every parameter (book-keeping's
        shares), None where no combination is formed."""
        if self.combined is None:
            return None
        return dict.fromkeys(self.trainable.names, self.weights[rows].to(self.trainable.dtype))

    def keep(self) -> None:
        """Hand what was formed to the check."""
        if self.combined is not None:
            keep_combination(self.trainable, self.weights, self.combined.complete(), self.direction, self.dots)
