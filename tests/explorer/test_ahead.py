"""The menu's networks computed ahead while the explorer idles (issue 29): the model's ``ahead`` (a setting's
gradients, verdict and fast timings, kept for its visit), the worker's idle work (runs only while nothing is asked
for, gives way to any job at its next check) and the explorer doing it between visits."""

from __future__ import annotations

import threading
import time

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402
from helpers import flatten_ref, ref_grads  # noqa: E402

from pergrad_viz import widgets  # noqa: E402
from pergrad_viz.explorer import model as model_module  # noqa: E402
from pergrad_viz.explorer.model import ExplorerModel, Setting, Stale  # noqa: E402
from pergrad_viz.explorer.worker import TURN, Job, Worker  # noqa: E402

FAST = {"rounds": 2, "min_rounds": 1, "min_block_s": 1e-4, "tier_budget_s": 0.05, "threads": 1,
        "noise_threshold": float("inf"), "drift": float("inf")}
SETTING = Setting(model="cnn", batch=4, hidden=4, strategies=("hooks", "torch_func", "loop"))
WAIT_S = 60.0


def _calls(monkeypatch) -> list[str]:
    """The package calls the explorer's model makes from now on (their strategies)."""
    calls, real = [], model_module.per_sample_grads

    def spy(*args, **kwargs):
        calls.append(kwargs.get("strategy"))
        return real(*args, **kwargs)

    monkeypatch.setattr(model_module, "per_sample_grads", spy)
    return calls


def test_a_setting_computed_ahead_is_shown_at_once_and_right(monkeypatch):
    m = ExplorerModel(batch_options=(1, 2, 4), slow_limit=16, sweep_batches=2, **FAST)
    assert m.ahead(SETTING)
    calls = _calls(monkeypatch)
    views = []
    for view in m.stages(SETTING):
        views.append(view)
        if view.shown:
            break
    assert calls == []  # nothing computed again before the view is shown in full: gradients, verdict, fast timings
    first = views[0]
    assert first.verdict is not None and first.verdict.ok  # the verdict with the first figures
    fast = {r.strategy for r in views[-1].records if r.median_s is not None}
    assert {"hooks", "torch_func"} <= fast and views[-1].reused >= len(fast)
    assert {r.batch_size for r in views[-1].scaling_records} == {1, 4}
    model, loss_fn, x, y, _ = m.problem(SETTING)  # the values are the setting's own, against a loop written here
    expected = flatten_ref(ref_grads(model, loss_fn, x, y), lead=1)
    torch.testing.assert_close(first.grads, expected, rtol=1e-4, atol=1e-5)
    last = list(m.stages(SETTING))[-1]  # the slow baseline is timed at the visit
    assert last.done and any(r.strategy == "loop" and r.median_s is not None for r in last.records)
    assert "loop" in calls


def test_ahead_stopped_midway_keeps_what_it_computed(monkeypatch):
    m = ExplorerModel(batch_options=(1, 2, 4), slow_limit=16, sweep_batches=2, **FAST)
    polls = []

    def check():
        polls.append(1)
        if len(polls) == 1:  # right after the gradients' view: the learner moved a control
            raise Stale

    with pytest.raises(Stale):
        m.ahead(SETTING, check)
    calls = _calls(monkeypatch)
    stages = m.stages(SETTING)
    first, second = next(stages), next(stages)
    assert calls == []  # the gradients kept, not computed again
    assert first.verdict is None and second.verdict.ok  # the verdict was not reached ahead: computed now
    stages.close()


def test_idle_work_runs_only_when_nothing_is_asked_for_and_gives_way_at_once():
    ran, checks, gave_way = [], [], threading.Event()
    started, turn = threading.Event(), []

    def idle(check):
        turn.append(TURN.locked())  # held like a job's: nothing else times meanwhile
        started.set()
        try:
            for _ in range(2000):
                time.sleep(0.005)
                checks.append(1)
                check()
        except Stale:
            gave_way.set()
            raise
        return False

    worker = Worker(lambda job: ran.append((job.setting.batch, gave_way.is_set())), idle=idle)
    try:
        assert started.wait(WAIT_S)
        t = time.perf_counter()
        worker.submit(Job(Setting(batch=2)))
        assert worker.wait(WAIT_S)
        assert ran == [(2, True)] and time.perf_counter() - t < 5  # the job ran once idle work gave way
        assert turn and all(turn)
    finally:
        worker.stop(WAIT_S)
    assert not worker.alive


def test_no_idle_work_while_another_explorer_waits():
    started = threading.Event()
    with TURN:  # another explorer's job runs
        worker = Worker(lambda job: None, idle=lambda check: started.set() or False)
        time.sleep(4 * 0.25)
        assert not started.is_set()
    assert started.wait(WAIT_S)
    worker.stop(WAIT_S)


def test_the_explorer_computes_the_menu_ahead_between_visits(monkeypatch):
    options = {"batch_sizes": (1, 2, 4), "hidden_widths": (8,), "default_batch": 4, "default_hidden": 8,
               "sweep_batches": 2, "slow_limit": 16, "dpi": 40, **FAST}
    ex = widgets.explorer(models=("mlp", "cnn"), strategies=("hooks", "torch_func"), **options)
    try:
        assert ex.wait(WAIT_S) and ex.view.done
        deadline = time.monotonic() + WAIT_S
        while len(ahead := {(k.batch, k.method) for k in ex.model.cache if k.model == "cnn"}) < 8:
            assert time.monotonic() < deadline, ahead  # the fast ones and the references at B=1 and B=4
            time.sleep(0.05)
        calls = _calls(monkeypatch)
        ex.set(model="cnn")
        assert ex.wait(WAIT_S) and ex.view.done and ex.error == ""
        assert calls == [] and ex.view.setting.hidden == 8 and ex.view.verdict.ok  # all timed ahead: reused
        assert f"{len(ex.view.records)} reused from earlier" in ex.view.progress
    finally:
        ex.close()
