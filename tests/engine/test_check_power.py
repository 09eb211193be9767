"""The per-call check's power and its silence (engine.certify, engine.schedule): a single wrong or misplaced row of 64
is caught within 2 calls in every strategy; float32 rounding, even where a reduction cancels, is no verdict; the
schedule checks a plan's first calls, then within its share of the time. References: plain loops (tests/helpers.py)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from helpers import ref_grads, ref_jacobian
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core.batch import Batch
from pergrad_viz.core.trainable import Trainable, restoring_modes
from pergrad_viz.engine import certify, schedule
from pergrad_viz.strategies import REGISTRY
from pergrad_viz.tutorial.networks import MLP

BATCHED = ("hooks", "autograd_stack", "batched_grad")


@pytest.fixture(autouse=True)
def seeded_check(monkeypatch):
    monkeypatch.setattr(certify, "_DRAW", random.Random(2026))


def _tutorial(batch: int = 64):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    return MLP(784, 20, 10), torch.randn(batch, 1, 28, 28, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _swap(t: torch.Tensor) -> None:
    t[[3, 40]] = t[[40, 3]].clone()


def _scale(t: torch.Tensor) -> None:
    t[17].mul_(1.5)


def _zero(t: torch.Tensor) -> None:
    t[17].zero_()


FAULTS = {"row 17 scaled by 1.5": _scale, "row 17 zeroed": _zero, "rows 3 and 40 swapped": _swap}


def _planted(strategy: str, fault, parameter: str, quantity: str = "grads"):
    """The strategy's record with ``fault`` applied to one parameter's rows of what it writes."""
    real = REGISTRY[strategy]

    def grads(trainable, loss_fn, inputs, targets, out):
        real.grads(trainable, loss_fn, inputs, targets, out)
        fault(out[parameter])

    def jacobian(trainable, inputs, out):
        real.jacobian(trainable, inputs, out)
        fault(out[parameter])

    return dataclasses.replace(real, grads=grads if quantity == "grads" else real.grads,
                               jacobian=jacobian if quantity == "jacobian" else real.jacobian)


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
@pytest.mark.parametrize("parameter", ["fc1.bias", "fc2.weight"])
@pytest.mark.parametrize("strategy", [*BATCHED, "torch_func"])
def test_one_wrong_row_of_64_is_caught_within_two_calls(monkeypatch, strategy, parameter, fault):
    model, x, y = _tutorial()
    names = [n for n, _ in model.named_parameters()]
    parameter = parameter if parameter in names else names[1]
    monkeypatch.setitem(REGISTRY, strategy, _planted(strategy, FAULTS[fault], parameter))
    caught = 0
    for _ in range(2):
        try:
            pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy=strategy)
        except certify.CheckFailedError as e:
            caught += 1
            assert parameter in str(e) or "sample" in str(e)
    assert caught >= 1, f"{fault} in {parameter} passed 2 calls of {strategy}"


@pytest.mark.parametrize("strategy", ["hooks", "torch_func"])
def test_one_wrong_jacobian_row_is_caught_and_auto_returns_the_definition(monkeypatch, strategy):
    model, x, _ = _tutorial(16)
    model = model.double()
    x = x.double()
    parameter = next(n for n, _ in model.named_parameters())
    monkeypatch.setitem(REGISTRY, strategy, _planted(strategy, _scale if x.shape[0] > 17 else _swap_small, parameter,
                                                     "jacobian"))
    with pytest.raises(certify.CheckFailedError):
        pv.per_sample_jacobian(model, x, strategy=strategy)
    want = ref_jacobian(model, x)
    got = pv.per_sample_jacobian(model, x)  # auto hands over (hooks -> torch_func -> loop)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)


def _swap_small(t: torch.Tensor) -> None:
    t[[2, 9]] = t[[9, 2]].clone()


def test_auto_hands_over_from_a_wrong_torch_func_to_the_loop_and_remembers(monkeypatch):
    model, x, y = _tutorial(16)
    model, x = model.double(), x.double()
    monkeypatch.setitem(REGISTRY, "torch_func", _planted("torch_func", _swap_small, "fc1.weight"))
    monkeypatch.setitem(REGISTRY, "hooks", _planted("hooks", _swap_small, "fc1.weight"))
    want = ref_grads(model, nn.CrossEntropyLoss(), x, y)
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
    assert pv.resolve_strategy("auto", model, x) == "loop"


class Centred(nn.Module):
    """Tokens far from zero, centred over the tokens after a Linear: the exact gradient of ``proj.bias`` is 0 and
    ``proj.weight``'s is a sum whose terms cancel (float32 keeps 2-3 digits of it, in any order of summation)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        h = self.proj(x)
        h = h - h.mean(1, keepdim=True)
        return self.head(torch.tanh(h).mean(1))


def _float32_cases():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    centred = (Centred(), 3000 + torch.randn(16, 32, 16, generator=g), torch.randint(0, 3, (16,), generator=g))
    model, x, y = _tutorial(16)
    conv = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    return {"centred tokens": centred, "tutorial MLP": (model, x, y), "conv + group norm": (conv, x, y)}


@pytest.mark.parametrize("case", ["centred tokens", "tutorial MLP", "conv + group norm"])
def test_no_false_alarm_in_200_float32_checks(case, monkeypatch):
    """A float32 result that is right (the loop's own) checked 200 times as from every strategy: rounding, even
    where a float32 sum cancels (the old per-tensor tolerance refused 'centred tokens'), is no verdict."""
    model, x, y = _float32_cases()[case]
    loss = nn.CrossEntropyLoss()
    rows = pv.per_sample_grads(model, loss, x, y, strategy="loop")
    trainable, inputs = Trainable.of(model), Batch.of(x)
    alarms = 0
    for k in range(200):
        try:
            with restoring_modes(trainable):
                certify.check_grads(trainable, loss, inputs, y, rows, "hooks", batched=k % 4 != 0)
        except certify.CheckFailedError:
            alarms += 1
    assert alarms == 0


def test_the_float64_settlement_still_fails_a_wrong_float32_row():
    model, x, y = _float32_cases()["centred tokens"]
    loss = nn.CrossEntropyLoss()
    rows = pv.per_sample_grads(model, loss, x, y, strategy="loop")
    trainable, inputs = Trainable.of(model), Batch.of(x)
    for name, factor in (("head.bias", 1.05), ("head.weight", 3.0)):  # float32 keeps 4 digits of one, 2 of the other
        wrong = {n: t.clone() for n, t in rows.items()}
        wrong[name][5] *= factor
        with restoring_modes(trainable), pytest.raises(certify.CheckFailedError, match=name):
            certify.check_grads(trainable, loss, inputs, y, wrong, "hooks")


def test_the_schedule_checks_first_calls_then_within_its_share(monkeypatch):
    model, x, y = _tutorial(16)
    checked = []
    real = certify.check_grads
    monkeypatch.setattr(pv.api, "check_grads", lambda *a, **k: (checked.append(1), real(*a, **k)))
    for _ in range(schedule.FIRST):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert len(checked) == schedule.FIRST
    s = schedule.schedule_for(Trainable.of(model), Batch.of(x), "grads", "hooks")
    assert s.calls == schedule.FIRST and s.checks == schedule.FIRST
    first, longest = s.check_seconds, s.last_check
    for _ in range(40):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
        longest = max(longest, s.last_check)
    assert s.calls == schedule.FIRST + 40
    assert s.checks < s.calls  # a check costs about a plain forward and backward: far from every call
    # Each later check ran where the time spent, with the last one's cost, was within the share of computing.
    assert s.check_seconds - first <= schedule.SHARE * s.compute_seconds + 2 * longest
    model.fc1 = nn.Linear(784, 20)  # a new layer: a new plan key, a new schedule, its first calls checked
    before = len(checked)
    pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert len(checked) == before + 1


def test_what_a_check_makes_the_next_call_pay_is_the_check_s(monkeypatch):
    """A check's references, freed, can leave the next call faulting its tensors' pages in again: that call's time
    beyond a typical call's (per sample, times its batch size) is counted as the check's, so checks run less often."""
    clock = iter(range(10**6))
    monkeypatch.setattr(schedule.time, "perf_counter", lambda: float(next(clock)))  # every check takes 1 s
    s = schedule.Schedule()
    for batch in (32, 32, 16, 32, 32):  # no check: 0.05 s per sample (a 16-sample call, 0.8 s)
        s.computed(0.05 * batch, batch)
    with s.checking():
        pass
    s.computed(1.6, 32)  # the checked call itself, as before
    assert s.check_seconds == 1.0
    s.computed(2.4, 32)  # the next call: 0.8 s over a typical one, the check's
    assert s.check_seconds == pytest.approx(1.8) and s.last_check == pytest.approx(1.8)
    s.computed(0.8, 16)  # then as before: nothing added, and it counts as typical again
    assert s.check_seconds == pytest.approx(1.8) and len(s.recent) == 5  # the checked call itself was typical
    plain = schedule.Schedule()
    for _ in range(5):
        plain.computed(1.6, 32)
    assert plain.check_seconds == 0 and plain.recent == [0.05] * (5 - schedule.FIRST)  # the first calls: not typical


def test_the_first_calls_one_time_costs_do_not_starve_the_checks(monkeypatch):
    """Found by a probe: a plan's first check paid a one-time start-up (1 s against 4 ms after it) and was charged to
    the 10% budget, so a 1 ms call was not checked again for 10,000 calls, while a coupling switched on through
    state the plan's key does not see went out wrong on every one of them. The first calls and their checks, made
    always, stay out of the account: the next check comes after some 40 calls."""
    ticks = iter([0.0, 1.0, 1.0, 1.004])  # the first check takes 1 s, the second 4 ms
    monkeypatch.setattr(schedule.time, "perf_counter", lambda: next(ticks))
    s = schedule.Schedule()
    for seconds in (0.33, 0.001)[:schedule.FIRST]:  # a cold first call, then a usual one
        assert s.due()
        with s.checking():
            pass
        s.computed(seconds)
    calls = 0
    while not s.due():
        s.computed(0.001)
        calls += 1
    assert 30 <= calls <= 41  # 4 ms of check within 10% of 1 ms calls


@pytest.mark.parametrize("cold_first_s", [0.0, 0.5])
def test_auto_times_torch_func_against_hooks_and_keeps_the_faster(monkeypatch, cold_first_s):
    """The race (engine.schedule.Race): hooks' first calls, then torch_func timed; here torch_func is made the
    faster (hooks slowed down), so auto runs it from then on, and its results are the loop's. torch.func's start-up
    lands on the process's first call (0.9 s against 3 ms the next; ``cold_first_s`` here): that call is not timed
    against hooks, so torch_func still wins."""
    import time

    model, x, y = _tutorial(8)
    model, x = model.double(), x.double()
    monkeypatch.setitem(schedule.WARMED, "torch_func", False)
    used = []

    def slowed(name, first_delay, delay):
        record = REGISTRY[name]

        def grads(*args):
            used.append(name)
            time.sleep(first_delay if used.count(name) == 1 else delay)
            record.grads(*args)

        monkeypatch.setitem(REGISTRY, name, dataclasses.replace(record, grads=grads))

    slowed("hooks", 0.05, 0.05)
    slowed("torch_func", cold_first_s, 0.0)
    want = ref_grads(model, nn.CrossEntropyLoss(), x, y)
    for _ in range(6):
        got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
    assert used[:schedule.FIRST] == ["hooks"] * schedule.FIRST
    assert used[schedule.FIRST:] == ["torch_func"] * (6 - schedule.FIRST)
    assert schedule.WARMED["torch_func"]
