"""pergrad_viz.bench.timing: interleaved rounds, statistics and the noisy flag, on a fake clock (no real timing)."""

from __future__ import annotations

import math

import pytest
import torch

from pergrad_viz.bench import timing


class FakeClock:
    """A clock that only moves when a fake method runs: each call costs the method's price (plus a stall)."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []
        self.stall_at: set[int] = set()  # call indices that take 10x longer

    def __call__(self) -> float:
        return self.now

    def method(self, name: str, cost: float):
        def fn():
            slow = len(self.calls) in self.stall_at
            self.calls.append(name)
            self.now += cost * (10 if slow else 1)
        return fn


def test_summarize_median_iqr_and_noise():
    t = timing.summarize([1.0, 1.0, 1.1, 1.0, 0.9])
    assert t.median_s == 1.0 and t.iqr_s == pytest.approx(0.0) and not t.noisy
    noisy = timing.summarize([1.0, 2.0, 3.0, 4.0])
    assert noisy.iqr_s == pytest.approx(1.5) and noisy.noisy and noisy.spread == pytest.approx(0.6)
    assert timing.summarize([float("nan")]).noisy
    with pytest.raises(ValueError, match="no samples"):
        timing.summarize([])


def test_rounds_interleave_rotate_and_reverse():
    clock = FakeClock()
    fns = {n: clock.method(n, 0.01) for n in "abc"}
    out = timing.time_interleaved(fns, rounds=3, min_block_s=0.0, clock=clock, warmup=True)
    assert list(out) == ["a", "b", "c"]
    warm, timed = clock.calls[:3], clock.calls[3:]
    assert warm == ["a", "b", "c"]
    # round r starts at method r mod 3, and odd rounds run backwards: every method follows two different ones
    assert timed == ["a", "b", "c", "a", "c", "b", "c", "a", "b"]
    for t in out.values():
        assert t.median_s == pytest.approx(0.01) and t.samples == pytest.approx((0.01,) * 3) and not t.noisy


def test_blocks_of_many_calls_for_fast_methods():
    clock = FakeClock()
    out = timing.time_interleaved({"fast": clock.method("fast", 1e-4), "slow": clock.method("slow", 0.01)},
                                  rounds=2, min_block_s=1e-3, clock=clock, estimates={"fast": 1e-4, "slow": 0.01})
    assert out["fast"].number == 10 and out["slow"].number == 1
    assert out["fast"].median_s == pytest.approx(1e-4)
    assert clock.calls.count("fast") == 20  # no warm-up call when the estimate is given


def test_a_stall_hits_one_round_and_shows_as_spread():
    clock = FakeClock()
    clock.stall_at = {2 + 2 * 2}  # round 2's first block (warm-ups are calls 0-1)
    out = timing.time_interleaved({"a": clock.method("a", 0.01), "b": clock.method("b", 0.01)}, rounds=5,
                                  min_block_s=0.0, clock=clock)
    assert out["a"].median_s == pytest.approx(0.01) and out["b"].median_s == pytest.approx(0.01)
    assert max(out["a"].samples) == pytest.approx(0.1)  # the stall landed in one round of one method ...
    assert out["a"].noisy is False  # ... and the median and IQR of 5 rounds shrug it off


def test_prior_samples_count_as_first_rounds():
    clock = FakeClock()
    out = timing.time_interleaved({"a": clock.method("a", 0.01), "b": clock.method("b", 0.5)}, rounds=3,
                                  min_block_s=0.0, clock=clock, estimates={"a": 0.01}, prior={"b": [0.5]})
    assert clock.calls == ["a", "a", "b", "a", "b"]  # round 0: only a; b sits it out (its warm-up counted)
    assert out["b"].samples == pytest.approx((0.5, 0.5, 0.5)) and len(out["a"].samples) == 3


def test_check_abandons_between_blocks():
    clock = FakeClock()
    seen = []

    def check():
        seen.append(len(clock.calls))
        if len(seen) > 3:
            raise KeyboardInterrupt("stale")

    with pytest.raises(KeyboardInterrupt):
        timing.time_interleaved({"a": clock.method("a", 0.01)}, rounds=10, min_block_s=0.0, clock=clock, check=check)
    assert len(clock.calls) == 3  # warm-up + 2 blocks, then abandoned


def test_plan_tiers_cheapest_first_within_budget():
    est = {"loop": 0.3, "hooks": 0.001, "torch_func": 0.002, "slow": 2.0, "fb": 0.0005, "floor": 0.0001}
    tiers = timing.plan_tiers(est, round_budget_s=0.05, first=("fb", "floor"))
    assert tiers[0][:2] == ["fb", "floor"] and tiers[0][2:] == ["hooks", "torch_func"]
    assert tiers[1:] == [["loop"], ["slow"]]
    assert sorted(n for t in tiers for n in t) == sorted(est)
    # a costly method still joins the first tier when nothing else did
    assert timing.plan_tiers({"fb": 0.001, "big": 1.0}, round_budget_s=0.01, first=("fb",)) == [["fb", "big"]]


def test_drifted_and_headroom():
    a, b = timing.summarize([1.0] * 3), timing.summarize([1.4] * 3)
    assert not timing.drifted(a, b) and timing.drifted(a, timing.summarize([2.0] * 3))
    assert timing.headroom_threads(2) == 1 and timing.headroom_threads(1) == 1 and timing.headroom_threads(8) == 7
    assert timing.headroom_threads() >= 1


# ------------------------------------------------------------------------------------------ adaptive rounds


def seq_method(clock: FakeClock, name: str, cost):
    """A fake method whose k-th call (its own count, warm-up included) costs ``cost(k)`` seconds."""
    count = [0]

    def fn():
        clock.calls.append(name)
        clock.now += cost(count[0])
        count[0] += 1
    return fn


def run_adaptive(fns, clock, **patience):
    return list(timing.time_adaptive(fns, patience=timing.Patience(**patience), min_block_s=0.0, clock=clock))


def test_uncertainty_is_the_medians_confidence_half_width():
    t = timing.summarize([1.0, 1.0, 1.2, 1.4, 1.0, 1.0, 1.0, 1.1, 0.9])  # IQR 0.1, median 1.0, 9 rounds
    assert t.uncertainty == pytest.approx(1.57 * 0.1 / 3)
    assert timing.summarize([float("nan"), 1.0]).uncertainty == float("inf")


def test_steady_methods_are_final_after_the_first_pass():
    clock = FakeClock()
    fns = {"a": clock.method("a", 0.01), "b": clock.method("b", 0.02)}
    passes = run_adaptive(fns, clock, rounds=5, max_rounds=15)
    assert [final for _, final in passes] == [True]  # nothing provisional: no second figure
    (timings, _), = passes
    assert all(len(t.samples) == 5 and not t.noisy for t in timings.values())


def test_early_stalls_get_more_rounds_and_then_settle():
    clock = FakeClock()
    stalls = {1, 3}  # two of the first five rounds (call 0 is the warm-up) run 3x slower: a busy moment
    fns = {"a": seq_method(clock, "a", lambda k: 0.03 if k in stalls else 0.01), "b": clock.method("b", 0.01)}
    passes = run_adaptive(fns, clock, rounds=5, max_rounds=15, budget_s=10.0)
    first, _ = passes[0]
    assert passes[0][1] is False and first["a"].uncertainty > 0.15  # shown as provisional, not as noise
    last, final = passes[-1]
    assert final and len(passes) >= 2
    assert len(last["a"].samples) > 5 and len(last["a"].samples) == len(last["b"].samples)  # still interleaved
    assert not last["a"].noisy and last["a"].median_s == pytest.approx(0.01)


def test_a_machine_that_stays_busy_is_flagged_within_the_bounds():
    clock = FakeClock()
    fns = {"a": seq_method(clock, "a", lambda k: 0.01 * (1, 3)[k % 2]), "b": clock.method("b", 0.01)}
    passes = run_adaptive(fns, clock, rounds=5, max_rounds=12, budget_s=10.0)
    last, final = passes[-1]
    assert final and last["a"].noisy and not last["b"].noisy
    assert len(last["a"].samples) == 12  # the rounds ran out: 5, then 10, then 12
    assert [len(t["a"].samples) for t, _ in passes] == [5, 10, 12]


def test_the_budget_bounds_the_extra_rounds():
    clock = FakeClock()
    fns = {"slow": seq_method(clock, "slow", lambda k: 0.5 * (1, 3)[k % 2])}
    start = clock.now
    passes = run_adaptive(fns, clock, rounds=3, max_rounds=50, budget_s=2.0)
    first_pass_s = 0.5 + 1.5 + 0.5 + 1.5  # the warm-up and 3 rounds
    assert clock.now - start - first_pass_s <= 2.0 + 1e-9
    last, final = passes[-1]
    assert final and last["slow"].noisy and len(last["slow"].samples) < 50


def test_extra_passes_time_longer_blocks():
    clock = FakeClock()
    fns = {"fast": seq_method(clock, "fast", lambda k: 1e-4 * (1, 3)[(k // 7) % 2])}  # uneven blocks
    passes = list(timing.time_adaptive(fns, patience=timing.Patience(rounds=3, max_rounds=6, budget_s=10.0,
                                                                     max_block_s=4e-3), min_block_s=1e-3,
                                       clock=clock))
    assert len(passes) >= 2 and passes[0][0]["fast"].number < passes[1][0]["fast"].number  # 1 ms blocks, then 2


def test_extra_rounds_policy():
    p = timing.Patience(rounds=5, max_rounds=15, budget_s=1.0, threshold=0.15)
    calm, busy = timing.summarize([1.0] * 5), timing.summarize([1.0, 2.0, 1.0, 2.0, 1.0])
    assert p.extra_rounds([calm], rounds_done=5, spent_s=0.0, round_s=0.01) == 0
    assert p.extra_rounds([calm, busy], rounds_done=5, spent_s=0.0, round_s=0.01) == 5  # doubles
    assert p.extra_rounds([busy], rounds_done=10, spent_s=0.0, round_s=0.01) == 5  # up to max_rounds
    assert p.extra_rounds([busy], rounds_done=5, spent_s=0.9, round_s=0.04) == 2  # what the budget allows
    assert p.extra_rounds([busy], rounds_done=5, spent_s=1.0, round_s=0.05) == 0
    with pytest.raises(ValueError, match="rounds"):
        next(timing.time_adaptive({}, patience=timing.Patience(rounds=5, max_rounds=3)))


# ------------------------------------------------------------------------------------------ CUDA synchronisation


class SyncedClock(FakeClock):
    """A fake clock that logs its readings, beside the synchronisations and the calls, in one list."""

    def __init__(self):
        super().__init__()
        self.events: list[str] = []

    def __call__(self) -> float:
        self.events.append("clock")
        return self.now

    def method(self, name: str, cost: float):
        fn = super().method(name, cost)

        def logged():
            self.events.append(name)
            fn()
        return logged


def _every_reading_synchronised(events: list[str]) -> bool:
    return all(i > 0 and events[i - 1] == "sync" for i, e in enumerate(events) if e == "clock")


def test_cuda_is_synchronised_before_every_clock_reading(monkeypatch):
    """With CUDA in use in the process, kernels run after the call returns: the clock must wait for them. Every
    reading of the clock (in the first pass, the extra rounds and the budget of time_adaptive) follows a
    torch.cuda.synchronize() (here a fake that logs; CUDA reported initialised)."""
    clock = SyncedClock()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: clock.events.append("sync"))
    timing.time_interleaved({"a": clock.method("a", 0.01), "b": clock.method("b", 0.02)}, rounds=3,
                            min_block_s=0.0, clock=clock)
    assert clock.events.count("clock") == 2 * (2 + 2 * 3) and _every_reading_synchronised(clock.events)
    assert clock.events[:4] == ["sync", "clock", "a", "sync"]  # the work is synchronised before the clock stops

    clock.events.clear()
    fns = {"a": seq_method(clock, "a", lambda k: 0.01 * (1, 3)[k % 2])}
    passes = run_adaptive(fns, clock, rounds=3, max_rounds=9, budget_s=10.0)
    assert len(passes) >= 2 and clock.events.count("clock") > 8 and _every_reading_synchronised(clock.events)


def test_synchronizer_follows_the_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    timing.synchronizer("cpu")()
    timing.synchronizer(torch.device("cuda", 1))()
    assert calls == [torch.device("cuda", 1)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # CUDA never used here: nothing to wait for
    timing.synchronizer()()
    timing.time_interleaved({"a": FakeClock().method("a", 0.01)}, rounds=2, min_block_s=0.0, clock=FakeClock())
    assert calls == [torch.device("cuda", 1)]


def test_steady_checks_start_the_check_account_afresh():
    """Calls before the rounds (under a profiler, say) earned the check credit that timed calls would spend on
    checks at nearly every call: after steady_checks the account holds only its own calls, the first checked."""
    from torch import nn

    import pergrad_viz as pv
    from pergrad_viz.core.batch import Batch
    from pergrad_viz.core.trainable import Trainable
    from pergrad_viz.engine import schedule

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x, y = torch.randn(5, 4), torch.randint(0, 2, (5,))

    def call():
        return pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")

    call()
    account = schedule.schedule_for(Trainable.of(model), Batch.of(x), "grads", "hooks")
    account.compute_seconds = 1e6  # as if the earlier calls had been very slow: checks due for a long while
    timing.steady_checks(model, [call])
    fresh = schedule.schedule_for(Trainable.of(model), Batch.of(x), "grads", "hooks")
    assert fresh is not account
    assert fresh.calls == schedule.FIRST + 3 and fresh.checks >= schedule.FIRST
    assert fresh.compute_seconds < 1e3


def test_paired_ratio_takes_each_rounds_ratio():
    """A slow spell of the machine (every method 1.7x slower) that one method meets a round before the other moves
    the ratio of the medians (3.4x), not the median of the rounds' own ratios (2x)."""
    base = timing.summarize([1.0, 1.0, 1.7, 1.7, 1.7])
    ours = timing.summarize([2.0, 2.0, 3.4, 3.4, 3.4])
    assert ours.median_s / base.median_s == pytest.approx(2.0)
    base = timing.summarize([1.0, 1.0, 1.0, 1.7, 1.7])
    ours = timing.summarize([2.0, 2.0, 3.4, 3.4, 3.4])  # round 3: ours in the spell, the base not yet
    assert ours.median_s / base.median_s == pytest.approx(3.4)
    assert timing.paired_ratio(ours, base) == pytest.approx(2.0)
    zero = timing.summarize([0.0, 0.0, 0.0, 0.0, 0.0])  # a review: no base to divide by, NaN, another run's rounds
    assert math.isnan(timing.paired_ratio(ours, zero))
    ones = timing.summarize([1.0] * 5)
    assert timing.paired_ratio(timing.summarize([2.0, float("nan"), 2.0, 2.0, 2.0]), ones) == pytest.approx(2.0)
    assert timing.paired_ratio(timing.summarize([2.0, 2.0, 2.0]), timing.summarize([1.0, 1.0])) == pytest.approx(2.0)
