"""The guarantee around DP-SGD steps: Poisson-sampled batches and the privacy accountant.

DP-SGD's (epsilon, delta) holds for batches drawn by Poisson sampling (each example in each step independently with
probability q, the sample rate), the clipped sum of :func:`pergrad_viz.clipped_grad_sum` with noise
``noise_multiplier * max_norm``, and the number of steps taken. The accounting is Opacus' (``opacus.accountants``:
RDP, or PRV), never written here: ``pip install 'pergrad-viz[dp]'``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from pergrad_viz.core.extras import missing_extra

ACCOUNTANTS = ("rdp", "prv")


class PoissonBatches:
    """A batch sampler: ``steps`` batches of indices into a dataset of ``n`` examples, each example in each batch
    independently with probability ``sample_rate`` (Poisson sampling), drawn from ``generator`` alone.

    Use it as ``DataLoader(dataset, batch_sampler=PoissonBatches(len(dataset), q, generator=g))`` or iterate it for
    index tensors. A batch's size varies (its expected size is q * n: pass that to :func:`pergrad_viz.dp_step` as
    ``expected_batch_size``); a batch may be empty (probability (1 - q)^n): take the step anyway with
    :func:`pergrad_viz.noise_step`, so that the steps released are the ones the accountant counts.

    Args:
        n: examples in the dataset, a positive int.
        sample_rate: q in (0, 1].
        steps: batches per pass over this sampler; default ``round(1 / q)`` (one epoch in expectation).
        generator: a ``torch.Generator`` (CPU); required: the batches are part of the mechanism.
    """

    def __init__(self, n: int, sample_rate: float, *, steps: int | None = None,
                 generator: torch.Generator | None = None):
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

    def __iter__(self) -> Iterator[list[int]]:
        for _ in range(self.steps):
            mask = torch.rand(self.n, generator=self.generator) < self.sample_rate
            yield mask.nonzero().flatten().tolist()


def _accountants():
    try:
        from opacus import accountants
        from opacus.accountants.utils import get_noise_multiplier
    except ImportError as e:
        raise missing_extra("opacus", "the privacy accountant (pv.epsilon, pv.noise_multiplier_for)", extra="dp") from e
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
    """The epsilon of ``steps`` DP-SGD steps with Poisson sampling at rate q and noise std
    ``noise_multiplier * max_norm``, at this ``delta``, by Opacus' accountant (``"rdp"`` or ``"prv"``)."""
    _check(sample_rate, steps, delta, accountant)
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, int | float) \
            or not math.isfinite(noise_multiplier) or noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be a finite number > 0 (no noise: no guarantee), got "
                         f"{noise_multiplier!r}")
    accountants, _ = _accountants()
    acc = accountants.RDPAccountant() if accountant == "rdp" else accountants.PRVAccountant()
    acc.history = [(float(noise_multiplier), float(sample_rate), steps)]
    return float(acc.get_epsilon(delta=delta))


def noise_multiplier_for(target_epsilon: float, sample_rate: float, steps: int, delta: float, *,
                         accountant: str = "rdp") -> float:
    """The smallest noise multiplier (to Opacus' tolerance, 0.01 in epsilon) whose ``steps`` steps at rate q stay
    within ``target_epsilon`` at ``delta``."""
    _check(sample_rate, steps, delta, accountant)
    if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, int | float) \
            or not math.isfinite(target_epsilon) or target_epsilon <= 0:
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    _, get_noise_multiplier = _accountants()
    return float(get_noise_multiplier(target_epsilon=float(target_epsilon), target_delta=float(delta),
                                      sample_rate=float(sample_rate), steps=steps, accountant=accountant))
