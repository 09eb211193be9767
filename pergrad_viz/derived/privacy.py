"""The guarantee around DP-SGD steps: Poisson-sampled batches and the privacy accountant.

DP-SGD's (epsilon, delta) holds for batches drawn by Poisson sampling (each example in each step independently with
probability q, the sample rate), the clipped sum of :func:`pergrad_viz.clipped_grad_sum` with noise
``noise_multiplier * max_norm``, and the number of steps taken. The accounting is Opacus' (``opacus.accountants``:
RDP, or PRV), never written here: ``pip install 'pergrad-viz[dp]'``.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import logging
import math
import numbers
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pergrad_viz.core.extras import missing_extra
from pergrad_viz.core.numbers import number_of
from pergrad_viz.core.users import FILTERS

ACCOUNTANTS = ("rdp", "prv")


def _real(value: object) -> object:
    """A numpy or 0-dim tensor number as a Python float (an int stays an int); anything else as it is (refused by
    the checks below, naming it)."""
    if isinstance(value, bool) or isinstance(value, int | float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    number = number_of(value)
    if isinstance(number, float) and float(number).is_integer() and "int" in str(getattr(value, "dtype", "")):
        return int(number)
    return value if number is None or isinstance(number, complex) else number


class PoissonBatches:
    """A batch sampler: ``steps`` batches of indices into a dataset of ``n`` examples, each example in each batch
    independently with probability ``sample_rate`` (Poisson sampling), drawn from ``generator`` alone.

    Use it as ``DataLoader(dataset, batch_sampler=sampler, collate_fn=sampler.collate(dataset))`` (:meth:`collate`:
    an empty batch as 0 rows, which PyTorch's own collate cannot make) or iterate it for index lists. A batch's
    size varies (its expected size is q * n: pass that to :func:`pergrad_viz.dp_step` as ``expected_batch_size``);
    a batch may be empty (probability (1 - q)^n): take the step anyway (``dp_step`` on 0 rows is
    :func:`pergrad_viz.noise_step`), so that the steps released are the ones the accountant counts.

    Args:
        n: examples in the dataset, a positive int.
        sample_rate: q in (0, 1].
        steps: batches per pass over this sampler; default ``round(1 / q)`` (one epoch in expectation).
        generator: a ``torch.Generator`` (CPU); required: the batches are part of the mechanism.
    """

    def __init__(self, n: int, sample_rate: float, *, steps: int | None = None,
                 generator: torch.Generator | None = None):
        n, sample_rate, steps = _real(n), _real(sample_rate), _real(steps)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (the dataset's size), got {n!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int | float) or not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be a number in (0, 1] (e.g. batch_size / n), got {sample_rate!r}")
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"steps must be a positive int or None (round(1 / sample_rate)), got {steps!r}")
        if not isinstance(generator, torch.Generator):
            raise TypeError("generator must be a torch.Generator, e.g. torch.Generator().manual_seed(seed): the "
                            "batches are drawn from it alone (never from torch's global generator)")
        self.n, self.sample_rate, self.generator = n, float(sample_rate), generator
        self.steps = steps if steps is not None else max(1, round(1 / sample_rate))

    @property
    def expected_batch_size(self) -> int:
        """round(q * n), at least 1: what :func:`pergrad_viz.dp_step` divides the clipped sum by."""
        return max(1, round(self.sample_rate * self.n))

    def __len__(self) -> int:
        return self.steps

    def collate(self, dataset, collate_fn=None):
        """A ``collate_fn`` for ``DataLoader(dataset, batch_sampler=self, collate_fn=...)``: ``collate_fn`` (default:
        PyTorch's ``default_collate``), and for an empty batch, which that cannot collate, the dataset's first
        example collated with 0 rows, so that :func:`pergrad_viz.dp_step` takes the noise step there."""
        from torch.utils.data import default_collate

        self.collating = True
        return PoissonCollate(dataset, default_collate if collate_fn is None else collate_fn)

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.n, generator=self.generator) < self.sample_rate
            batch = mask.nonzero().flatten().tolist()
            loader = "torch/utils/data" in sys._getframe(1).f_code.co_filename  # iterated by a DataLoader
            if not batch and loader and not getattr(self, "collating", False):
                warnings.warn("an empty batch, as Poisson sampling draws them: PyTorch's default collate cannot make "
                              "one (an IndexError follows); pass collate_fn=sampler.collate(dataset) to the DataLoader",
                              UserWarning, stacklevel=2)
            yield batch


class PoissonCollate:
    """:meth:`PoissonBatches.collate`'s ``collate_fn``, an object so that DataLoader workers started by spawn or
    forkserver (macOS, Windows) can be sent it: ``inner(batch)``, and for an empty batch what ``inner`` makes of the
    dataset's first example with every per-example part emptied: where the collate of the example twice holds twice
    as many (a tensor's rows, a list or tuple's items, in dicts, ``UserDict`` s such as a Hugging Face
    ``BatchEncoding``, lists and tuples), none; a part of another kind is refused (its rows of ``dataset[0]`` would
    be trained on as a sample)."""

    def __init__(self, dataset, inner: Callable):
        self.dataset, self.inner = dataset, inner

    def __call__(self, batch: list):
        if batch:
            return self.inner(batch)
        first = self.dataset[0]
        return _emptied(self.inner([first]), self.inner([first, first]))


def _emptied(one: object, two: object) -> object:
    """``one`` (one example collated) with each part that ``two`` (the example twice) holds twice of emptied."""
    if isinstance(one, torch.Tensor):
        doubled = isinstance(two, torch.Tensor) and one.dim() and two.dim() and two.shape[0] == 2 * one.shape[0]
        return one[:0] if doubled else one
    if isinstance(one, collections.UserDict):  # a BatchEncoding: the same object kind, its data emptied
        empty = copy.copy(one)
        empty.data = {k: _emptied(v, two[k]) for k, v in one.data.items()}
        return empty
    if isinstance(one, dict):
        items = {k: _emptied(v, two[k]) for k, v in one.items()}
        try:
            return type(one)(items)
        except TypeError:
            return items
    if isinstance(one, list | tuple):
        if not hasattr(one, "_fields") and one and len(two) == 2 * len(one):  # one item per example
            return type(one)()
        items = [_emptied(a, b) for a, b in zip(one, two, strict=True)]
        return type(one)(*items) if hasattr(one, "_fields") else type(one)(items)
    if one is None or isinstance(one, str | bytes | numbers.Number):
        return one
    raise TypeError(f"PoissonBatches.collate cannot make an empty batch from a collated {type(one).__name__} (its "
                    "rows of the dataset's first example would be trained on): make collate_fn return tensors in "
                    "dicts, lists or tuples")


def _accountants():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:  # Opacus' import calls logging.basicConfig and adds warnings filters: the user's process left as it was
        with FILTERS, warnings.catch_warnings():
            from opacus import accountants
            from opacus.accountants.utils import get_noise_multiplier
    except ImportError as e:
        raise missing_extra("opacus", "the privacy accountant (pv.epsilon, pv.noise_multiplier_for)", extra="dp") from e
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    return accountants, get_noise_multiplier


def _check(sample_rate: float, steps: int, delta: float, accountant: str) -> None:
    if not isinstance(sample_rate, int | float) or isinstance(sample_rate, bool) or not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    if not isinstance(delta, int | float) or isinstance(delta, bool) or not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1) (typically below 1 / dataset size), got {delta!r}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def epsilon(noise_multiplier: float, sample_rate: float, steps: int, delta: float, *,
            accountant: str = "rdp") -> float:
    """The epsilon of ``steps`` DP-SGD steps with Poisson sampling at rate q and noise std ``noise_multiplier``
    times the clipping bound, at this ``delta``, by Opacus' accountant (``"rdp"`` or ``"prv"``)."""
    noise_multiplier, sample_rate, steps, delta = map(_real, (noise_multiplier, sample_rate, steps, delta))
    _check(sample_rate, steps, delta, accountant)
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, int | float) \
            or not math.isfinite(noise_multiplier) or noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be a finite number > 0 (no noise: no guarantee), got "
                         f"{noise_multiplier!r}")
    accountants, _ = _accountants()
    acc = accountants.RDPAccountant() if accountant == "rdp" else accountants.PRVAccountant()
    acc.history = [(float(noise_multiplier), float(sample_rate), steps)]
    with FILTERS, warnings.catch_warnings():  # the PRV accountant's log(1 - q) at q = 1, inside its numerics
        warnings.filterwarnings("ignore", "divide by zero encountered in log", RuntimeWarning)
        return float(acc.get_epsilon(delta=delta))


def noise_multiplier_for(target_epsilon: float, sample_rate: float, steps: int, delta: float, *,
                         accountant: str = "rdp") -> float:
    """The smallest noise multiplier (to Opacus' tolerance, 0.01 in epsilon) whose ``steps`` steps at rate q stay
    within ``target_epsilon`` at ``delta``. A target no multiplier meets is refused after Opacus' search up to its
    largest multiplier, which can take half a minute (10,000 steps at q = 0.5)."""
    target_epsilon, sample_rate, steps, delta = map(_real, (target_epsilon, sample_rate, steps, delta))
    _check(sample_rate, steps, delta, accountant)
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, int | float) \
            or not math.isfinite(target_epsilon) or target_epsilon <= 0:
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    _, get_noise_multiplier = _accountants()
    try:
        with FILTERS, warnings.catch_warnings():  # Opacus' RDP note on a multiplier it tried, not on the answer
            warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")
            found = float(get_noise_multiplier(target_epsilon=float(target_epsilon), target_delta=float(delta),
                                               sample_rate=float(sample_rate), steps=steps, accountant=accountant))
    except ValueError as e:
        if "too low" not in str(e):
            raise
        raise ValueError(
            f"no noise multiplier Opacus' {accountant} accountant can find keeps {steps} steps at sample rate "
            f"{sample_rate} within epsilon {target_epsilon} at delta {delta} (it searches multipliers up to a bound: "
            f"{e}); take a larger target_epsilon, fewer steps or a smaller sample rate (sample_rate=batch/dataset)"
        ) from e
    epsilon(found, sample_rate, steps, delta, accountant=accountant)  # the note again where it concerns the answer
    return found


_NOISE_STARTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per model: its last noised steps' starts


@contextlib.contextmanager
def new_noise(model: nn.Module, generator: torch.Generator | None, noise_multiplier: float,
              distributed: bool = False) -> Iterator[None]:
    """A noised step of ``model``: a warning where ``generator`` starts where one of its last 64 noised steps started
    (a fresh ``torch.Generator().manual_seed(s)`` at every step): the noise repeats, and two released gradients with
    the same noise give it away. Said, and the start noted, once the step succeeded (a refused one draws nothing, and
    may be taken again). Under ``distributed`` only rank 0 draws: the others' generators stay where they are, as they
    should."""
    if generator is None or not noise_multiplier > 0 or (distributed and torch.distributed.get_rank() != 0):
        yield
        return
    start = _start(generator.get_state())
    seen = _NOISE_STARTS.setdefault(model, collections.deque(maxlen=64))
    yield
    if start in seen:  # said once the step is taken: a refused one draws nothing
        warnings.warn("the noise generator starts where an earlier step's started (a fresh generator seeded alike at "
                      "every step?): this step's noise repeats that one's, and the repeated noise can be subtracted "
                      "out. Create the generator once, before training, and pass the same one at every step",
                      UserWarning, stacklevel=callers_level())
    seen.append(start)


def forget_noise(model: nn.Module, state: torch.Tensor) -> None:
    """A step that drew its noise from ``state`` and then failed (its generator put back): not a step taken."""
    seen, start = _NOISE_STARTS.get(model), _start(state)
    if seen is not None and start in seen:
        seen.remove(start)


def _start(state: torch.Tensor) -> int:
    return hash(state.numpy().tobytes())


def callers_level() -> int:
    """The ``stacklevel`` of the first frame outside the package (and contextlib), for a warning raised here."""
    package = __file__.rsplit("derived", 1)[0]
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith((package, contextlib.__file__.rsplit(".", 1)[0])):
        frame, level = frame.f_back, level + 1
    return level


def warn_own_size() -> None:
    """Warn (once per line of the caller's, Python's default) that a noised ``dp_step`` divided by its batch's own
    size: a private quantity, and not the expected size Poisson sampling's accounting assumes."""
    warnings.warn("dp_step divided the noised sum by this batch's own size (expected_batch_size=None): with Poisson "
                  "batches, the sampling pv.epsilon accounts for, pass expected_batch_size=sampler.expected_batch_size "
                  "(a batch's own size is itself private); with shuffled batches of a fixed size pv.epsilon's "
                  "guarantee does not hold", UserWarning, stacklevel=4)


def warn_class_weights(loss_fn: object, targets: object) -> None:
    """Warn where a class-weighted ``CrossEntropyLoss`` / ``NLLLoss`` with reduction='mean' meets one class index per
    sample: a sample's loss is its own weighted mean, w_y l / w_y = l, so the weights divide out of every sample's
    gradient (as in a loop over samples), unlike in the batch's weighted mean of plain training."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)) and loss_fn.reduction == "mean" \
            and loss_fn.weight is not None and isinstance(targets, torch.Tensor) and targets.dim() == 1 \
            and not targets.is_floating_point():
        warnings.warn("loss_fn has class weights and reduction='mean': each sample's loss is its own weighted mean, "
                      "w_y l / w_y = l, so the weights divide out of every sample's gradient. For class-weighted "
                      "per-sample losses pass reduction='sum' (dp_step divides by the expected batch size)",
                      UserWarning, stacklevel=callers_level())
