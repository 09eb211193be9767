"""pergrad_viz.timing: interleaved rounds, statistics and the noisy flag, on a fake clock (no real timing)."""

from __future__ import annotations

import pytest

from pergrad_viz import timing


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
