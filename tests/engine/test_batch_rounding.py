"""A batch whose kernels round more coarsely than a sample alone (cuDNN's TF32 convolutions for 32 samples against
one on an H200: a ResNet-18 gradient 7e-2 from float64 in its batch, 7e-4 alone) is no interaction: the probe settles
a float32 difference on a float64 copy (engine.probe), and the per-call check allows a row as far off as the batch's
own value for that sample (engine.certify). A coupling, or a wrong row, is still caught. The model here rounds its
hidden layer to bfloat16 inside a batch of more than one, in float32 only: what such kernels do, on a CPU.
References: plain loops of autograd in this file."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import in_batch_grads
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core.batch import Batch
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.engine import certify


class RoundsInBatch(nn.Module):
    """Identity alone; in a batch of float32, the values rounded to bfloat16 (8 bits: a coarser kernel's rounding).
    ``couple``: the batch's mean added too, in any precision (a real interaction)."""

    def __init__(self, couple: float = 0.0):
        super().__init__()
        self.couple = couple

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1 and x.dtype == torch.float32:
            x = x + (x.bfloat16().float() - x).detach()  # the batch's rounding, the same gradient
        return x + self.couple * x.mean(0, keepdim=True)


def _model(couple: float = 0.0) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 32), RoundsInBatch(couple), nn.Tanh(), nn.Linear(32, 5))


def _data(batch: int = 16):
    g = torch.Generator().manual_seed(1)
    return torch.randn(batch, 12, generator=g), torch.randint(0, 5, (batch,), generator=g)


@pytest.fixture(autouse=True)
def seeded_check(monkeypatch):
    monkeypatch.setattr(certify, "_DRAW", random.Random(2026))


def test_the_batch_rounding_is_no_interaction_and_the_rows_are_the_batch_s():
    model, (x, y) = _model(), _data()
    loss_fn = nn.CrossEntropyLoss()
    in_batch = in_batch_grads(model, x, y)
    exact = in_batch_grads(model.double(), x.double(), y)  # float64: no rounding in the batch
    model.float()
    for _ in range(3):  # the checked first calls: each checks a sample alone
        rows = pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
    for name, want in in_batch.items():
        torch.testing.assert_close(rows[name], want, rtol=1e-4, atol=1e-6)
    # far from float64's beyond float32's rounding: what the check had to allow
    off = max(float((rows[n].double() - e).norm() / e.norm()) for n, e in exact.items())
    assert off > 1e-3
    sums = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, strategy="hooks")
    factors = (0.5 / (torch.stack([t.flatten(1).norm(dim=1) for t in in_batch.values()]).norm(dim=0) + 1e-6)).clamp(
        max=1)
    for name, want in in_batch.items():
        torch.testing.assert_close(sums[name], torch.einsum("b,b...->...", factors, want), rtol=1e-4, atol=1e-6)


def test_a_coupling_is_still_refused():
    model, (x, y) = _model(couple=0.05), _data()
    with pytest.raises(pv.UnsupportedModelError, match="interact"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")


@pytest.mark.parametrize("factor", [1.3, 0.0])
def test_a_wrong_row_still_fails_the_check(factor):
    model, (x, y) = _model(), _data()
    loss_fn = nn.CrossEntropyLoss()
    rows = in_batch_grads(model, x, y)
    trainable, inputs = Trainable.of(model), Batch.of(x)
    caught = 0
    for i in range(len(x)):
        wrong = {n: t.clone() for n, t in rows.items()}
        wrong["0.weight"][i] *= factor
        with restoring_modes(trainable):
            try:
                certify._check_alone(trainable, loss_fn, inputs, y, wrong, "hooks", i)
            except certify.CheckFailedError as e:
                assert "0.weight" in str(e)
                caught += 1
    assert caught == len(x)


def test_the_right_rows_pass_the_check_of_every_sample_alone():
    model, (x, y) = _model(), _data()
    loss_fn = nn.CrossEntropyLoss()
    rows = in_batch_grads(model, x, y)
    trainable, inputs = Trainable.of(model), Batch.of(x)
    with restoring_modes(trainable):
        for i in range(len(x)):
            certify._check_alone(trainable, loss_fn, inputs, y, rows, "hooks", i)
