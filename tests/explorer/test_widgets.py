"""The explorer's view (pergrad_viz.explorer.view), driven from code as a slider move would (no kernel, no browser;
Agg backend). The model's own behaviour is tested in test_explorer_model.py.

One small explorer is shared (batch sizes 1..8, hidden widths 8/16, a tiny timing budget), running its work in
the control's callback (``background=False``) so that each test sees a finished view; the background worker
(cancellation, latest setting wins) has tests of its own.
"""

from __future__ import annotations

import gc
import struct
import threading
import time
import weakref

import matplotlib

matplotlib.use("Agg")

import ipywidgets as w  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import pergrad_viz as pv  # noqa: E402
from pergrad_viz import widgets
from pergrad_viz.bench import sweeps as bench  # noqa: E402
from pergrad_viz.explorer import model as model_module  # noqa: E402
from pergrad_viz.explorer import page as page_module  # noqa: E402
from pergrad_viz.explorer import panels  # noqa: E402
from pergrad_viz.explorer.specs import MENU, installed  # noqa: E402

OPTIONS = {"batch_sizes": (1, 2, 4, 8), "hidden_widths": (8, 16), "default_batch": 4, "default_hidden": 8,
           "sweep_batches": 2, "slow_limit": 16, "dpi": 40, "rounds": 2, "min_rounds": 1, "min_block_s": 1e-4,
           "tier_budget_s": 0.05, "threads": 1, "noise_threshold": float("inf"), "drift": float("inf"),
           "ahead": False}  # the menu computed ahead while idle: its own tests (test_ahead.py)


@pytest.fixture(scope="module")
def ex():
    return widgets.explorer(background=False, **OPTIONS)


@pytest.fixture
def fresh(ex):
    ex.set(model="mlp", batch=4, hidden=8, quantity="grads", strategies=list(pv.STRATEGIES), sample=0)
    assert ex.error == ""
    return ex


def png_size(data: bytes) -> tuple[int, int]:
    assert data.startswith(b"\x89PNG")
    return struct.unpack(">II", data[16:24])


def shown(ex) -> dict[str, w.Image]:
    return {k: i for k, i in ex.images.items() if i.layout.display != "none"}


def test_controls(ex):
    assert isinstance(ex, w.VBox)
    assert ex.batch_slider.description == "batch size" and ex.hidden_slider.description == "hidden width"
    for s in (ex.batch_slider, ex.hidden_slider, ex.sample_slider, ex.clip_slider):
        assert s.continuous_update is False
    assert ex.batch_slider.options == (1, 2, 4, 8) and ex.hidden_slider.options == (8, 16)
    assert list(ex.strategy_boxes) == list(pv.STRATEGIES)
    assert dict(ex.quantity_toggle.options) == {"per-sample gradients": "grads", "output Jacobian": "jacobian"}
    assert ex.clip_slider.description == "clipping threshold C"


def test_thin_reexport_and_options():
    assert widgets.Explorer is pv.widgets.Explorer and callable(pv.widgets.explorer)
    ex = widgets.explorer(hidden_widths=(8, 16, 32), default_hidden=20, compute=False)
    assert ex.hidden_slider.options == (8, 16, 20, 32) and ex.hidden_slider.value == 20
    with pytest.raises(ValueError, match="unknown strategies"):
        widgets.explorer(strategies=("loop", "nope"), compute=False)


def test_every_panel_drawn_at_the_size_it_is_shown(fresh):
    images = shown(fresh)
    assert set(images) == {"heatmap", "images", "rule", "clip", "bars", "runtime"}
    for name, image in images.items():
        width, _height = png_size(bytes(image.value))
        assert image.layout.width == f"{width}px", name  # CSS width = pixel width: never stretched
        assert image.layout.height == "auto" and image.layout.max_width == "100%"
    assert plt.get_fignums() == []  # nothing registered with pyplot: no figure leaks


def test_progress_status_and_table_name_the_setting(fresh):
    progress = fresh.progress_html.value
    assert "data-state='done'" in progress
    assert "done: timed 7 of 7 methods at batch size B=4, hidden width 8" in progress
    assert fresh.status.startswith("hooks, loop, autograd_stack, torch_func, batched_grad agree with the loop (the "
                                   "definition) on the per-sample gradients at batch size B=4")
    assert "all 4 samples checked against the loop" in fresh.status
    assert fresh.max_difference is not None and fresh.max_difference < 1e-4
    assert "data-ok='true'" in fresh.status_html.value and ">agree</b>" in fresh.status_html.value
    assert "<table" in fresh.table_html.value and "batch size B=4, hidden width 8" in fresh.table_html.value
    assert {(r.quantity, r.batch_size, r.hidden) for r in fresh.records} == {("grads", 4, 8)}


def test_table_in_microseconds_against_the_loop_with_its_caption_above(fresh):
    table = fresh.table_html.value
    assert "<caption" not in table and table.index("median: time per call") < table.index("<table")
    assert "max |diff| vs loop" in table and "the largest difference from the loop (the definition) on all 4" in table
    assert " us<" not in table and ("µs<" in table or "ms<" in table)
    assert "<th" in table and "quantity</th>" not in table


def test_sample_slider_redraws_the_sample_panels_only(fresh):
    before = dict(fresh.drawn)
    records = fresh.records
    fresh.sample_slider.value = 3
    after = fresh.drawn
    assert {k for k in after if after[k] != before[k]} == {"heatmap", "images", "rule"}
    assert fresh.view.sample.index == 3 and fresh.records == records


def test_clip_slider_redraws_the_dp_view_only(fresh):
    before = dict(fresh.drawn)
    fresh.clip_slider.value = 2.0
    after = fresh.drawn
    assert {k for k in after if after[k] != before[k]} == {"clip"}
    assert fresh.view.clipping.max_norm == pytest.approx(2.0)


def test_the_dp_view_says_how_the_clipped_sum_is_formed_without_the_per_sample_matrix(ex):
    def boxes(widget):
        yield widget
        for child in getattr(widget, "children", ()):
            yield from boxes(child)

    dp_view, = (b for b in boxes(ex) if ex.clip_slider in getattr(b, "children", ()))
    words = " ".join(c.value for c in dp_view.children if isinstance(c, w.HTML))
    assert "The DP-SGD view" in words
    for said in ("pv.clipped_grad_sum", "pv.dp_step", "ghost norms", "G<sup>T</sup> diag(c) A", "(B, P)"):
        assert said in words, said


def test_batch_size_change_recomputes(fresh):
    before = dict(fresh.drawn)
    fresh.batch_slider.value = 8
    assert {(r.quantity, r.batch_size, r.hidden) for r in fresh.records} == {("grads", 8, 8)}
    assert all(fresh.drawn[k] > before[k] for k in ("heatmap", "bars", "runtime"))
    assert {r.batch_size for r in fresh.scaling_records} == {1, 8}
    assert fresh.sample_slider.max == 7
    assert "B=8" in fresh.table_html.value


def test_skip_note_above_slow_limit(fresh):
    fresh.set(batch=8)  # the loop: 8 passes; the other two 8 x 8 = 64 > slow_limit=16
    assert {r.strategy for r in fresh.records if r.skipped} == {"autograd_stack", "batched_grad"}
    assert "skipped as too slow" in fresh.status and "slow_limit=16" in fresh.status
    assert "skipped as too slow" in fresh.status_html.value
    assert fresh.slow_limit_dropdown.description in fresh.status  # the advice names the control to use


def test_the_slow_limit_control_times_the_skipped_methods(fresh):
    fresh.set(batch=8)
    assert fresh.slow_limit_dropdown.value == 16 and 256 in [v for _, v in fresh.slow_limit_dropdown.options]
    fresh.slow_limit_dropdown.value = 256
    assert not any(r.skipped for r in fresh.records)
    assert {"autograd_stack", "batched_grad"} <= {r.strategy for r in fresh.records}
    assert fresh.view.setting.slow_limit == 256 and "skipped as too slow" not in fresh.status
    fresh.slow_limit_dropdown.value = 16
    assert {r.strategy for r in fresh.records if r.skipped} == {"autograd_stack", "batched_grad"}


def test_quantity_toggle_gives_jacobian_records(fresh):
    fresh.quantity_toggle.value = "jacobian"
    assert {(r.quantity, r.batch_size, r.hidden) for r in fresh.records} == {("jacobian", 4, 8)}
    assert "output Jacobian" in fresh.status
    assert {r.strategy for r in fresh.records if r.skipped} == {"loop", "autograd_stack", "batched_grad"}


def test_the_jacobian_heatmap_fits_its_figure(fresh):
    from helpers import outside

    fresh.set(quantity="jacobian")
    assert outside(panels.heatmap_figure(fresh.view)) == []


def test_unchecking_a_strategy_removes_it(fresh):
    fresh.strategy_boxes["torch_func"].value = False
    assert "torch_func" not in {r.strategy for r in fresh.records}
    assert "torch_func" not in {r.strategy for r in fresh.scaling_records}
    assert {"loop", "hooks", bench.FORWARD_BACKWARD} <= {r.strategy for r in fresh.records}


def test_errors_are_shown_and_the_ui_keeps_working(fresh, monkeypatch):
    def too_big(*args, **kwargs):
        raise pv.MemoryBudgetError("would need about 9.00 GiB; use a smaller batch")

    monkeypatch.setattr(fresh.model, "check", too_big)
    fresh.batch_slider.value = 8  # no exception escapes the callback
    assert "MemoryBudgetError" in fresh.error and "smaller batch" in fresh.error
    assert "MemoryBudgetError" in fresh.error_html.value and "data-state='error'" in fresh.progress_html.value
    assert "previous setting (batch size B=4" in fresh.error_html.value
    monkeypatch.undo()
    fresh.batch_slider.value = 2
    assert fresh.error == "" and fresh.error_html.value == ""
    assert {(r.batch_size, r.hidden) for r in fresh.records} == {(2, 8)}


def test_a_wrong_strategy_shows_disagree_in_the_widget(monkeypatch):
    real = model_module.per_sample_grads

    def shifted(*args, **kwargs):  # torch_func's rows moved by one sample
        out = real(*args, **kwargs)
        return out.roll(1, dims=0) if kwargs.get("strategy") == "torch_func" else out

    monkeypatch.setattr(model_module, "per_sample_grads", shifted)
    ex = widgets.explorer(background=False, **{**OPTIONS, "strategies": ("hooks", "torch_func")})
    assert ex.error == "" and ex.view.done
    assert "data-ok='false'" in ex.status_html.value and ">DISAGREE</b>" in ex.status_html.value
    assert ">agree</b>" not in ex.status_html.value
    assert ex.status.startswith("torch_func DISAGREE with the loop")
    assert ex.max_difference > 1e-3
    ex.close()


def test_rerun_times_again(fresh):
    fresh.set(batch=2)
    before = fresh.drawn["bars"]
    fresh.rerun_button.click()
    assert fresh.view.reused == 0 and fresh.drawn["bars"] > before


def test_snapshot_displays_the_figures_as_pictures(fresh, monkeypatch):
    import IPython.display

    shown_objects = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown_objects.extend(objs))
    fresh.snapshot()
    images = [o for o in shown_objects if isinstance(o, IPython.display.Image)]
    assert len(images) == 6 and all(o.width == png_size(o.data)[0] for o in images)
    assert "batch size B=4, hidden width 8" in shown_objects[0].data


# ------------------------------------------------------------------------------------------ the worker


def test_work_runs_off_the_callers_thread_and_the_latest_setting_wins(monkeypatch):
    threads, settings = set(), []
    real = model_module.ExplorerModel.stages

    def spy(self, setting, check=None):
        threads.add(threading.current_thread().name)
        settings.append(setting.batch)
        yield from real(self, setting, check)

    monkeypatch.setattr(model_module.ExplorerModel, "stages", spy)
    ex = widgets.explorer(**OPTIONS)
    start = time.perf_counter()
    for batch in (1, 2, 8, 1, 2):  # five quick moves: the callback returns at once each time
        ex.batch_slider.value = batch
    assert time.perf_counter() - start < 1.0
    assert ex.wait(120)
    assert threads == {"pergrad-explorer"}
    assert ex.view.setting.batch == 2 and ex.view.done and "data-state='done'" in ex.progress_html.value
    assert settings[-1] == 2 and len(settings) < 6  # stale settings dropped, not queued
    ex.close()


def test_a_new_sample_is_drawn_while_timing_goes_on(monkeypatch):
    ex = widgets.explorer(compute=False, **OPTIONS)
    started = threading.Event()
    real = model_module.ExplorerModel.stages

    def slow(self, setting, check=None):
        for view in real(self, setting, check):
            if view.stage == "timing":
                started.set()
                for _ in range(40):  # the front end moves the sample slider meanwhile
                    time.sleep(0.01)
                    check()
            yield view

    monkeypatch.setattr(model_module.ExplorerModel, "stages", slow)
    ex.refresh()
    assert started.wait(60)
    ex.sample_slider.value = 2
    assert ex.wait(120)
    assert ex.view.done and ex.view.setting.sample == 2 and ex.view.sample.index == 2
    ex.close()


def _workers() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "pergrad-explorer"}


@pytest.mark.parametrize("when", ["idle", "while working"])
def test_a_closed_explorer_is_freed_and_its_worker_ends(when):
    """Closing stops the worker (mid-job too: it gives up at its next check) and joins it, and closes every widget
    (their callbacks hold the explorer): nothing keeps the explorer's model, or its arrays, alive."""
    before = _workers()
    ex = widgets.explorer(**OPTIONS)
    if when == "idle":
        assert ex.wait(120) and ex.view.done
    (worker,) = _workers() - before
    model = weakref.ref(ex.model)
    start = time.perf_counter()
    ex.close()
    assert time.perf_counter() - start < 30 and not worker.is_alive()
    assert ex.view is None and not ex.busy and ex.wait(1)
    ex.refresh()  # a closed explorer computes nothing more
    del ex
    gc.collect()
    assert model() is None


def _thread_counts() -> tuple[int, int]:
    """torch's intra-op threads as this thread sees them, and as a new thread does (the process's setting)."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return torch.get_num_threads(), seen[0]


def test_the_thread_count_is_the_users_after_timings_and_after_close(monkeypatch):
    before = _thread_counts()
    threads = before[0] + 1  # not the user's: the explorer's own, while it computes
    inside = []
    real = model_module.per_sample_grads

    def spy(*args, **kwargs):
        inside.append(torch.get_num_threads())
        return real(*args, **kwargs)

    def drawing(self, view):  # between the steps of the work: the process's own count
        between.append(torch.get_num_threads())
        return real_show(self, view)

    between, real_show = [], page_module.Page.show
    monkeypatch.setattr(model_module, "per_sample_grads", spy)
    monkeypatch.setattr(page_module.Page, "show", drawing)
    ex = widgets.explorer(**{**OPTIONS, "threads": threads})
    assert ex.wait(120) and ex.view.done and ex.error == ""
    assert inside and set(inside) == {threads}
    assert between and set(between) == {before[0]}
    assert _thread_counts() == before
    ex.rerun_button.click()
    assert ex.wait(120) and ex.view.done
    assert _thread_counts() == before
    ex.close()
    assert _thread_counts() == before


def test_rerun_while_the_worker_times(monkeypatch):
    """"rerun timings" clicked while the worker times: the click only hands a job over (the worker alone reads
    and writes the timing cache), and the setting is timed again from scratch."""
    ex = widgets.explorer(compute=False, **OPTIONS)
    started = threading.Event()
    forgotten = []
    real_stages, real_forget = model_module.ExplorerModel.stages, model_module.ExplorerModel.forget

    def slow(self, setting, check=None):
        for view in real_stages(self, setting, check):
            if view.stage == "timing" and not started.is_set():
                started.set()
                for _ in range(40):
                    time.sleep(0.01)
                    check()
            yield view

    def forget(self, setting):
        forgotten.append(threading.current_thread().name)
        real_forget(self, setting)

    monkeypatch.setattr(model_module.ExplorerModel, "stages", slow)
    monkeypatch.setattr(model_module.ExplorerModel, "forget", forget)
    ex.refresh()
    assert started.wait(60)
    for _ in range(3):
        ex.rerun_button.click()
    assert ex.wait(120)
    assert ex.error == "" and ex.view.done and ex.view.reused == 0
    assert forgotten and set(forgotten) == {"pergrad-explorer"}
    ex.close()


# ------------------------------------------------------------------------------------------ the model menu


@pytest.mark.parametrize("key, width_name, widths, rule, first", [
    ("cnn", "channels", (4, 8, 16, 32, 64), "convolution", "conv1"),
    ("transformer", "d_model", (8, 16, 32, 64, 128), "embedding", "embed"),
    ("lstm", "hidden size", (8, 16, 32, 64, 128), "embedding", "embed"),
    pytest.param("vit-lora", "LoRA rank", (1, 2, 4, 8, 16, 32), "Linear layer",
                 "model.base_model.model.vit.layers.0.attention.q_proj.lora_A.default",
                 marks=pytest.mark.skipif(not installed("transformers", "peft"), reason="needs transformers, peft"))])
def test_the_model_menu_switches_every_panel(fresh, key, width_name, widths, rule, first):
    assert [v for _, v in fresh.model_dropdown.options] == list(MENU)  # "vit-lora" last, where installed
    drawn = dict(fresh.drawn)
    fresh.set(model=key, hidden=8, strategies=["hooks", "loop"])
    assert fresh.error == "" and fresh.view.setting.model == key and fresh.view.verdict.ok
    assert fresh.hidden_slider.description == width_name and fresh.hidden_slider.options == widths
    assert width_name in fresh.width_help.value
    assert all(fresh.drawn[p] > drawn[p] for p in ("heatmap", "images", "rule", "clip", "bars", "runtime"))
    assert rule in fresh.rule_text.value and f"<code>{first}</code>" in fresh.rule_text.value
    assert f"<code>{first}</code>" in fresh.layers_html.value and "closed-form rule" in fresh.layers_html.value
    assert f"data-setting='{key} B=4 hidden=8 grads'" in fresh.progress_html.value
    fresh.set(model="mlp")  # back: the MLP's own widths and the width chosen for it
    assert fresh.hidden_slider.description == "hidden width" and fresh.hidden_slider.options == (8, 16)
    assert fresh.hidden_slider.value == 8 and fresh.view.setting.model == "mlp"
    assert "Linear layer" in fresh.rule_text.value and "<code>fc1</code>" in fresh.layers_html.value


def test_a_model_change_from_the_dropdown_recomputes(fresh):
    fresh.model_dropdown.value = "cnn"  # as a click does
    assert fresh.view.setting.model == "cnn" and fresh.view.setting.hidden == 8 and fresh.error == ""
    assert {r.hidden for r in fresh.records} == {8} and fresh.hidden_slider.description == "channels"
    with pytest.raises(ValueError, match="unknown model 'vgg'"):
        fresh.set(model="vgg")
    explorer = widgets.explorer(models=("cnn", "lstm"), default_model="lstm", compute=False, **OPTIONS)
    assert [v for _, v in explorer.model_dropdown.options] == ["cnn", "lstm"]
    assert explorer.setting.model == "lstm" and explorer.setting.hidden == 32


def test_explorer_on_the_users_own_model():
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 3, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(27, 4))
    net.train()
    x, y = torch.randn(6, 1, 5, 5), torch.randint(0, 4, (6,))
    state = {k: v.clone() for k, v in net.state_dict().items()}
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    ex = widgets.explorer(model=net, loss_fn=loss_fn, data=(x, y), background=False,
                          **{**OPTIONS, "default_batch": 4, "hidden_widths": (8,)})
    assert ex.error == "" and ex.view.verdict.ok and ex.view.setting.model == "yours"
    assert ex.model_dropdown.layout.display == "none" and ex.hidden_slider.layout.display == "none"
    assert all(s.layout.display != "none" for s in (ex.batch_slider, ex.sample_slider, ex.clip_slider))
    assert "your model (Sequential)" in ex.width_help.value
    assert ex.batch_slider.options == (1, 2, 4, 6) and ex.view.grads.shape == (4, sum(p.numel() for p in
                                                                                     net.parameters()))
    assert "<code>0</code>" in ex.rule_text.value and ex.images["rule"].layout.display == ""
    assert "batch size B=4, your model" in ex.status
    expected = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        loss_fn(net(x[i:i + 1]), y[i:i + 1]), list(net.parameters()))]) for i in range(4)])
    assert torch.allclose(ex.view.grads, expected, atol=1e-5)
    assert all(torch.equal(v, state[k]) for k, v in net.state_dict().items()) and net.training
    assert all(p.grad is None for p in net.parameters())
    with pytest.raises(ValueError, match="needs loss_fn= and data="):
        widgets.explorer(model=net, compute=False)


def test_bad_options_with_your_own_model_are_refused_before_anything_runs():
    """Found by a probe: default_batch beyond the data, threads=0 and a device= with your own network were taken, and
    the widget then sat on an error (torch's own for the threads), too few class_names fell back to "class k"
    unsaid; a Dropout in training mode was refused naming randomness='different', which explorer() has not got."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Dropout(0.5), torch.nn.Linear(4, 3))
    data = (torch.randn(20, 5), torch.randint(0, 3, (20,)))
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    kw = {"model": net, "loss_fn": loss_fn, "data": data, "compute": False, "background": False}
    for bad, match in [({"default_batch": 100}, "runs up to 20"), ({"threads": 0}, "positive number"),
                       ({"device": "cuda:7"}, "leave device= out"), ({"class_names": ["a", "b"]}, "hold class 2"),
                       ({"default_batch": 8, "batch_sizes": (1, 2, 4)}, r"runs up to 4 .*max\(batch_sizes\)=4")]:
        with pytest.raises(ValueError, match=match):
            widgets.explorer(**kw, **bad)
    for fine in ({"device": torch.device("cpu")}, {"device": "cpu:0"}, {"device": None}, {"threads": np.int64(1)}):
        widgets.explorer(**kw, **fine).close()  # a review: the model's own device, a numpy thread count
    with pytest.raises(ValueError, match="torch knows"):
        widgets.explorer(device="gpu0", compute=False)
    ex = widgets.explorer(**{**kw, "compute": True}, threads=1, ahead=False, strategies=("hooks",), rounds=1,
                          sweep_batches=1)
    try:
        assert "model.eval()" in ex.error and "randomness" not in ex.error
    finally:
        ex.close()


def test_two_workers_in_one_process_take_turns():
    """Issue 19: two explorers in one kernel (the Voila dashboard shows two) must not compute and time at once, or
    each measures the other; a worker stopped while waiting for its turn drops its job."""
    from pergrad_viz.explorer.worker import Job, Worker

    running, overlaps, release = [], [], threading.Event()

    def run(job):
        overlaps.append(len(running))
        running.append(job)
        release.wait(5)
        running.remove(job)

    first, second, third = Worker(run), Worker(run), Worker(run)
    try:
        setting = pv.explorer.model.Setting()
        first.submit(Job(setting))
        time.sleep(0.1)
        second.submit(Job(setting))
        third.submit(Job(setting))
        time.sleep(0.2)
        assert len(running) == 1  # the others wait for their turn
        assert third.stop(timeout=1.0)  # stopped while waiting: it drops its job and ends
        release.set()
        assert first.wait(5) and second.wait(5)
        assert overlaps == [0, 0]  # first, then second; never two at once, and third never ran
    finally:
        release.set()
        for worker in (first, second, third):
            worker.stop(timeout=5)


def test_the_newest_job_goes_first_and_the_one_that_gave_way_runs_again():
    """A learner moving a control of one explorer while another explorer of the kernel works (the dashboard's
    second one computing its first setting) waits for it no longer: the running job gives way at its next check
    to the job submitted after it, then runs again; a job that waits with an older one does not interrupt."""
    from pergrad_viz.explorer.worker import Job, Worker

    order, started = [], threading.Event()

    def run_a(job):
        order.append("a starts")
        started.set()
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            if a.outranked():
                order.append("a gives way")
                return
            time.sleep(0.01)
        order.append("a ends")

    a, b = Worker(run_a), Worker(lambda job: order.append("b runs"))
    try:
        setting = pv.explorer.model.Setting()
        a.submit(Job(setting))
        assert started.wait(5)
        b.submit(Job(setting))
        assert b.wait(5) and a.wait(5)
        assert order == ["a starts", "a gives way", "b runs", "a starts", "a ends"]
    finally:
        a.stop(timeout=5)
        b.stop(timeout=5)


def test_layer_labels_are_short_and_tell_layers_apart():
    from pergrad_viz.explorer.panels import display_bounds, short_names

    assert short_names(["fc1", "layers.0.linear1", "body.head"]) == ["fc1", "0.linear1", "body.head"]
    peft = "model.base_model.model.vit.layers.{}.attention.{}_proj.lora_A.default"
    names = [peft.format(b, q) for b in (0, 1) for q in "qv"] + ["model.base_model.model.classifier.modules_to_save"
                                                                 ".default"]
    assert short_names(names) == ["0.attention.q_proj.lora_A", "0.attention.v_proj.lora_A",
                                  "1.attention.q_proj.lora_A", "1.attention.v_proj.lora_A", "model.classifier"]
    bounds = [(f"{n}.weight", 2 * k, 2 * k + 1) for k, n in enumerate(names)]
    bounds = sorted(bounds + [(f"{n}.bias", 2 * k + 1, 2 * k + 2) for k, n in enumerate(names)], key=lambda b: b[1])
    assert display_bounds(bounds) == [(s, 2 * k, 2 * k + 2) for k, s in enumerate(short_names(names))]


def test_an_image_beside_a_matrix():
    from pergrad_viz.explorer.panels import image_matrix_figure

    fig = image_matrix_figure(torch.rand(1, 28, 28), torch.randn(4, 32), row_labels=list("abcd"), title="t")
    image, matrix = fig.axes[:2]
    assert image.images[0].get_array().shape == (28, 28) and matrix.images[0].get_array().shape == (4, 32)


def test_while_the_slow_baselines_are_timed_the_page_says_so(ex, monkeypatch):
    """The "measuring" views: the scaling curve drawn (its title naming the baselines coming), the progress line
    ``data-state='measuring'``, and a row marked as coming for each slow baseline not yet timed; at "done" no row
    is marked any more."""
    seen, bars = [], []
    real, real_bars = page_module.Page.show, page_module.viz.bar_figure

    def spy(self, view):
        real(self, view)
        drawn = [(r.strategy, r.median_s) for r in bars[-1]] if bars else None
        seen.append((view.stage, self.progress_html.value, self.table_html.value,
                     self.images["runtime"].layout.display, drawn == [(r.strategy, r.median_s) for r in view.records]))

    def spy_bars(records, **kwargs):
        bars.append(list(records))
        return real_bars(records, **kwargs)

    monkeypatch.setattr(page_module.Page, "show", spy)
    monkeypatch.setattr(page_module.viz, "bar_figure", spy_bars)
    ex.set(model="mlp", batch=2, hidden=16, quantity="grads", strategies=list(pv.STRATEGIES))
    measuring = [s for s in seen if s[0] == "measuring"]
    assert measuring and seen[-1][0] == "done"
    _stage, progress, table, runtime, bars_final = measuring[0]
    assert bars_final  # the bar chart shows the rows of the shown view (not one drawn earlier, while timing)
    assert "data-state='measuring'" in progress and "still timing the slower methods" in progress
    coming = {m for m in ("loop", "autograd_stack", "batched_grad") if f"data-method='{m}'" in table}
    assert coming == {"loop", "autograd_stack", "batched_grad"} and "pergrad-coming" in table
    assert runtime == ""  # this setting's curve (another setting's is hidden first), its fast methods drawn
    assert "pergrad-coming" not in seen[-1][2] and "data-state='done'" in seen[-1][1]
    assert all("data-state='busy'" in s[1] for s in seen if s[0] in ("gradients", "timing"))
