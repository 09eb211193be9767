"""``randomness=``: what a call does with a forward that draws random numbers (dropout in training mode, stochastic
depth, noise), in the spirit of ``torch.func.vmap``'s option of that name.

* ``"error"`` (the default): such a forward is refused (:class:`~pergrad_viz.errors.UndefinedPerSampleError`),
  before anything is drawn from the caller's random state.
* ``"different"``: each sample's gradient is that of its own loss under the random numbers drawn for it, which is
  what one batched forward computes (each sample its own dropout mask). The loop runs each sample alone, drawing its
  own masks. The random numbers come from torch's global generator, as in training: the call advances it.

Under ``"different"`` a result stays checked (``pergrad_viz.engine.certify``): the state of the generator is noted at
the start of each batched forward a strategy runs (:class:`Draws`), and the check's reference forward of those rows
starts from the same state, so it draws the same masks. The probe, which compares runs of single samples with runs
of pairs, runs with the draws held fixed (:func:`held_fixed`: a dropout keeps every element), so that it sees the
structure of the model, not its masks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pergrad_viz.errors import UnsupportedModelError

RANDOMNESS = ("error", "different")

__all__ = ["RANDOMNESS", "DispatchMode", "Draws", "check_randomness", "held_fixed", "random_state", "randomness_of",
           "refuse_torch_func", "set_random_state"]


class DispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose ``__torch_dispatch__`` PyTorch leaves as written. PyTorch wraps every mode's in
    ``torch._disable_dynamo``, whose first call imports ``torch._dynamo`` (0.7 s); imported after
    ``torch.distributed.init_process_group``, that import keeps the gloo process group's threads alive past
    ``destroy_process_group``, and the process aborts at exit ("terminate called without an active exception", about
    one run of a DP step under torchrun in three). The package's modes never run under ``torch.compile``."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False


def check_randomness(randomness: object) -> None:
    """Raise ValueError naming the choices unless ``randomness`` is one of :data:`RANDOMNESS`."""
    if not isinstance(randomness, str) or randomness not in RANDOMNESS:
        raise ValueError(
            f"randomness must be 'error' (refuse a forward that draws random numbers, the default) or 'different' "
            f"(each sample's gradient under its own dropout mask, as one batched forward in training mode draws "
            f"them), got {randomness!r}")


def random_state(device: torch.device) -> tuple:
    """torch's global generator's state, and the CUDA one of ``device`` where it is a GPU."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def set_random_state(device: torch.device, state: tuple) -> None:
    """Put back a :func:`random_state`."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class Draws:
    """The global generator's state at the start of each batched forward of one call's strategy, in order of the rows
    they ran (the chunks, contiguous from row 0), so that the check can draw the same random numbers again."""

    def __init__(self, device: torch.device):
        self.device = device
        self.marks: list[tuple[slice, tuple]] = []
        self._next = 0
        self._initial: tuple | None = None

    def begin(self) -> None:
        """A strategy starts the batch: the marks are forgotten, and the generator is set back to the state the
        call's first strategy started from (so that after a hand-over the strategy that gives the result draws what
        it would have drawn alone, and the caller's generator ends as after that strategy alone)."""
        self.marks.clear()
        self._next = 0
        if self._initial is None:
            self._initial = random_state(self.device)
        else:
            set_random_state(self.device, self._initial)

    def mark(self, size: int) -> tuple:
        """Note the state before a batched forward of the next ``size`` rows; returns it (see :meth:`again`)."""
        state = random_state(self.device)
        self.marks.append((slice(self._next, self._next + size), state))
        self._next += size
        return state

    def again(self, state: tuple) -> None:
        """Set the generator back to ``state``: a forward run a second time (the capture's copying pass) draws the
        same random numbers as the first."""
        set_random_state(self.device, state)

    def chunks(self) -> list[slice]:
        """The rows of each marked forward, in order."""
        return [rows for rows, _ in self.marks]

    @contextmanager
    def replaying(self, rows: slice) -> Iterator[None]:
        """Run the block from the state noted for ``rows`` (one of :meth:`chunks`); the state is then set back to
        what it was before the block (the caller's generator advances as by the strategy alone)."""
        state = next(s for r, s in self.marks if r == rows)
        saved = random_state(self.device)
        set_random_state(self.device, state)
        try:
            yield
        finally:
            set_random_state(self.device, saved)

    def chunk_of(self, i: int) -> slice:
        """The marked rows that hold row ``i``."""
        return next(rows for rows in self.chunks() if rows.start <= i < rows.stop)


# A draw held fixed: the same value for every element, so that every row of a batch sees what a sample alone sees.
_CONSTANT = {"bernoulli_": 1.0, "bernoulli": 1.0, "randn": 0.0, "randn_like": 0.0, "normal_": 0.0, "rand": 0.5,
             "rand_like": 0.5, "uniform_": 0.5, "exponential_": 1.0}


class _HeldFixed(DispatchMode):
    """Seeded operations made deterministic and the same for every row: a Bernoulli draw (dropout's mask) keeps
    every element, dropout keeps its input, an attention kernel runs without its dropout, Gaussian noise is 0, uniform
    noise 0.5, a permutation the identity; any other draw comes from a generator seeded afresh for that call (the
    probe may then see the rows interact, and the call takes the loop)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded not in func.tags:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if any(a.name == "dropout_p" for a in func._schema.arguments):  # an attention kernel: without its dropout
            names = [a.name for a in func._schema.arguments]
            args = list(args)
            where = names.index("dropout_p")
            if where < len(args):
                args[where] = 0.0
            else:
                kwargs = {**kwargs, "dropout_p": 0.0}
            return func(*args, **kwargs)
        if name == "native_dropout":
            return args[0].clone(), torch.ones_like(args[0], dtype=torch.bool)
        if name == "randperm":
            return torch.arange(args[0], dtype=kwargs.get("dtype") or torch.int64, device=kwargs.get("device"))
        cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(0)
            result = func(*args, **kwargs)
        if name in _CONSTANT and isinstance(result, torch.Tensor) and result.is_floating_point():
            result.fill_(_CONSTANT[name])
        return result


@contextmanager
def held_fixed(active: bool = True) -> Iterator[None]:
    """Run the block with every random draw held fixed (see :class:`_HeldFixed`; ``active=False``: as it is); the
    caller's generator is untouched."""
    if not active:
        yield
        return
    with _HeldFixed():
        yield


def refuse_torch_func(trainable: object, strategy: str) -> None:
    """Under ``randomness="different"``, refuse ``torch_func``: its vmap draws numbers no check can draw again."""
    if strategy == "torch_func" and randomness_of(trainable) == "different":
        raise UnsupportedModelError(
            "randomness='different' runs the strategies that draw each sample's random numbers in one batched "
            "forward (hooks, autograd_stack, batched_grad) or alone (the loop), where the check can draw them again; "
            "torch_func's vmap draws its own, which nothing can check: use strategy='auto' or 'loop'")


def randomness_of(trainable: object) -> str:
    """The ``randomness=`` of the call a :class:`~pergrad_viz.core.trainable.Trainable` is made for."""
    return "error" if getattr(trainable.call, "draws", None) is None else "different"


def random_fix(trainable: object, turn_off: str = "turn it off", training: bool | None = None) -> str:
    """The fix a refusal of a forward that draws random numbers names: ``model.eval()`` where the model is in training
    mode (``training``: where the drawing layer is), else making the draw follow the mode (it draws in eval mode
    too); ``randomness='different'`` where the call takes it (``trainable.call.offers_randomness``)."""
    model = getattr(trainable, "model", trainable)
    if getattr(model, "training", True) if training is None else training:
        fix = f"Call model.eval() (or {turn_off}) first"
    else:
        fix = ("The model is in eval mode already, so the draw does not follow the mode: write it so that it does "
               f"(F.dropout(x, p, training=self.training)), or {turn_off}")
    if getattr(getattr(trainable, "call", None), "offers_randomness", False):
        fix += ", or pass randomness='different' for each sample's gradient under its own random numbers"
    return fix
