"""Errors raised by pergrad_viz, each with a message that names the fix."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """The model (or one of its layers) cannot be handled as asked.

    Raised for BatchNorm or Dropout in training mode (per-sample gradients are not defined, or are
    random), by the batched strategies where the samples interact, and by the ``hooks`` strategy where a layer
    cannot keep the samples apart (see :mod:`pergrad_viz.engine.probe`); the message names the layer and the fix.
    """


class UndefinedPerSampleError(UnsupportedModelError):
    """Per-sample gradients are not defined for the model as it is now, whatever the strategy: its forward draws
    random numbers, mixes the samples through batch statistics, or writes its buffers (``auto`` refuses too)."""


class HandOverError(UnsupportedModelError):
    """This fast path cannot give the definition for this call, although a slower exact one can: under
    ``strategy="auto"`` the call hands over (``hooks`` -> ``torch_func`` -> ``loop``); an explicit strategy raises it.

    ``reason``: what was found, as a phrase (the message is built from it; nothing parses the message)."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason


class CheckFailedError(HandOverError):
    """The per-call check (:mod:`pergrad_viz.engine.certify`) found a strategy's result differing from the
    definition by more than rounding: the plan that chose the strategy is demoted for this model. ``coupled``: the
    failure shows the samples interacting in a batched forward (every batched strategy is then refused), not only
    this strategy wrong."""

    def __init__(self, message: str, reason: str | None = None, coupled: bool = True):
        super().__init__(message, reason)
        self.coupled = coupled


class PlanMismatchError(HandOverError):
    """A call captured shapes the probe did not see (data-dependent behaviour): the layer rules cannot be trusted."""


# What a PlanMismatchError advises: torch.func cannot run every model (an LSTM), auto then takes the loop.
USE_AUTO = ("Use strategy='auto' (it switches to strategy='torch_func', or to the loop where torch.func cannot run "
            "the model).")


class VmapError(HandOverError):
    """``torch.func`` cannot run the model (an operation without a batching rule, data-dependent shapes, an
    ``autograd.Function`` without ``setup_context``), although the model alone runs."""


class MemoryBudgetError(MemoryError):
    """The result (and the working memory a strategy needs) would not fit the memory budget.

    Raised before anything large is allocated; the message gives the estimate.
    """


class MissingExtraError(ImportError):
    """A feature needs an optional package that is not installed. An ``ImportError``; the message names the
    extra that installs it, e.g. ``pip install 'pergrad-viz[viz]'`` (``.name`` is the missing module)."""


def human_bytes(n: float) -> str:
    """Format a byte count in binary units, e.g. ``human_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
