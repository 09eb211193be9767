"""The plan of the fast path for one model and input signature, as the probe (``engine.probe``) measured it: how
each layer's per-sample gradients are computed (:class:`LayerPlan`), along which dimension each of its tensors holds
the samples (:class:`CallSpec`), and whether the samples interact (:class:`Plan`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

SHARED = None  # the batch dimension of a tensor that holds no samples


class Unbatched(enum.Enum):
    """A tensor whose shape changes with the batch other than along one dimension (e.g. (B*T, d) rows)."""

    NOT_PER_SAMPLE = "not per-sample"


class LayerKind(enum.StrEnum):
    """How a layer's per-sample parameter gradients are computed (see :class:`LayerPlan`)."""

    RULE = "rule"
    CALL = "call"
    FALLBACK = "fallback"
    BROADCAST = "broadcast"


@dataclass(frozen=True)
class CallSpec:
    """One call of a layer: the batch dimension (or SHARED) and the shape without it, for every tensor leaf
    of its inputs (``(args, kwargs)`` flattened) and of its output."""

    in_dims: tuple[int | None, ...]
    in_rest: tuple[tuple[int, ...], ...]
    out_dims: tuple[int | None, ...]
    out_rest: tuple[tuple[int, ...], ...]


@dataclass
class LayerPlan:
    """A module whose per-sample parameter gradients come from its own calls.

    ``kind`` is ``RULE`` (a closed-form rule on (B, ...) input and output), ``CALL`` (a closed-form rule
    for a layer with several inputs / outputs, e.g. LSTM), ``FALLBACK`` (``torch.func`` on this layer
    alone) or ``BROADCAST`` (its parameters, each (1, ...), broadcast over the batch in its forward: a per-sample
    copy of each in the batched pass, see :mod:`pergrad_viz.engine.broadcast`). ``local`` maps the parameter's name
    inside the module (dotted for a descendant's parameter the module uses itself, e.g. MultiheadAttention's
    ``out_proj.weight``) to its full name.
    """

    name: str
    kind: LayerKind
    local: dict[str, str]
    calls: list[CallSpec] = field(default_factory=list)
    captures_checked: set = field(default_factory=set)  # kinds of call whose capturing forward equals the layer's
    spread: bool = False  # its calls hold no samples: its output (1, ...) goes downstream as a (B, ...) copy
    memo: dict = field(default_factory=dict)  # what a caller decided from a call's shapes alone (derived.bookkeeping)

    def check_capture(self, signature: tuple, same: bool) -> None:
        """The layer's capturing forward (its call rule's) was compared with its own forward for calls of this
        ``signature``: ``same``, or the layer takes the per-layer fallback from now on."""
        if same:
            self.captures_checked.add(signature)
        else:
            self.kind = LayerKind.FALLBACK


@dataclass
class Plan:
    layers: dict[str, LayerPlan]  # by module name, in named_modules() order
    interaction: str | None  # where the samples interact (None: they do not)
    hooks_problem: str | None  # why the hooks strategy cannot be used (None: it can)
    verified: bool  # the probe had two different samples (else interaction could not be tested)
    copy_captures: bool | frozenset = False  # once a forward modified captured tensors in place: those, or all
    failed: dict[str, str] = field(default_factory=dict)  # strategy -> why the per-call check found it wrong here
    lowest: dict = field(default_factory=dict)  # a hooked forward's calls -> the outputs its backward asks for
    graphs: set = field(default_factory=set)  # the graphs between the layers a passed check saw
    arguments_kept: bool = False  # a hooked pass found no layer changing a tensor it was called with
    changed_in_place: str | None = None  # why an unchecked hooked pass was refused (a layer changed its argument)
    lower_precision: str | None = None  # a layer computing below the parameters' precision (autocast in the forward)
    no_forward_mode: set = field(default_factory=set)  # what forward mode could not run (engine.forward_mode's screen)
    _planned: frozenset[str] | None = None

    @property
    def planned(self) -> frozenset[str]:
        """The full names of the parameters some layer handles (the others: no forward of the probe used them)."""
        if self._planned is None:
            self._planned = frozenset(full for lp in self.layers.values() for full in lp.local.values())
        return self._planned

    def demote(self, strategy: str, reason: str, batched: bool, coupled: bool = True) -> None:
        """The per-call check found ``strategy`` wrong here (``reason``, a phrase): ``auto`` skips it, an explicit
        call is refused. ``batched`` (it ran the model on the whole batch) and ``coupled`` (the failure shows the
        samples interacting there): every batched strategy is refused; else that strategy alone."""
        self.failed[strategy] = reason
        if batched and coupled:
            self.interacting(reason)
        elif strategy == "hooks" and self.hooks_problem is None:
            self.hooks_problem = reason

    def interacting(self, reason: str) -> None:
        """The samples were found interacting (``reason``, a phrase) after the probe: every batched strategy is
        refused from now on (a first finding is kept)."""
        if self.interaction is None:
            self.interaction = f"the samples interact: {reason}"

    def copy_captured_tensors(self, which: bool | frozenset = True) -> None:
        """A forward modified captured tensors in place (``ReLU(inplace=True)``, ``out += x``): capture copies them
        (``which``: (layer, call, position) keys, or True: all) from now on for this model and input signature."""
        self.copy_captures = which

    def remember_lowest(self, calls: tuple, positions: tuple[int, ...]) -> None:
        """``positions``: the outputs of these ``calls`` (their keys) whose backward graph reaches no other's."""
        self.lowest[calls] = positions
