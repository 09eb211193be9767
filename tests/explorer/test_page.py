"""The explorer's page keeps the figures it drew as PNGs by their token: a setting seen again, or drawn ahead
(``Page.prerender``, for the network computed ahead), shows them without drawing, the same bytes."""

from __future__ import annotations

import dataclasses

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from pergrad_viz import widgets  # noqa: E402

OPTIONS = {"batch_sizes": (1, 2, 4), "hidden_widths": (8, 16), "default_batch": 4, "default_hidden": 8,
           "sweep_batches": 2, "slow_limit": 16, "dpi": 40, "rounds": 2, "min_rounds": 1, "min_block_s": 1e-4,
           "tier_budget_s": 0.05, "threads": 1, "noise_threshold": float("inf"), "drift": float("inf"),
           "ahead": False, "models": ("mlp", "cnn")}
GRADIENT_PANELS = ("heatmap", "images", "rule", "clip")


@pytest.fixture(scope="module")
def ex():
    ex = widgets.explorer(background=False, **OPTIONS)
    yield ex
    ex.close()


def pngs(ex) -> dict[str, bytes]:
    return {p: bytes(ex.images[p].value) for p in GRADIENT_PANELS}


def test_a_setting_seen_again_shows_its_figures_without_drawing_them(ex):
    ex.set(model="mlp", batch=4, sample=1)
    first = pngs(ex)
    ex.set(batch=2, sample=0)
    assert pngs(ex) != first
    rendered, drawn = dict(ex.page.rendered), dict(ex.drawn)
    ex.set(batch=4, sample=1)
    assert ex.error == ""
    assert {p: ex.page.rendered[p] - rendered[p] for p in GRADIENT_PANELS} == dict.fromkeys(GRADIENT_PANELS, 0)
    assert all(ex.drawn[p] > drawn[p] for p in GRADIENT_PANELS)  # shown anew
    assert pngs(ex) == first


def test_a_network_drawn_ahead_is_shown_without_drawing_and_as_drawn_on_its_visit(ex):
    ex.set(model="mlp", batch=4, sample=0)
    ahead = dataclasses.replace(ex.setting, model="cnn", hidden=ex.specs["cnn"].default_width)
    view = ex.model.ahead(ahead)
    assert view is not None and view.shown and view.setting == ahead
    rendered = dict(ex.page.rendered)
    ex.page.prerender(view)
    assert all(ex.page.rendered[p] == rendered[p] + 1 for p in GRADIENT_PANELS)
    rendered = dict(ex.page.rendered)
    ex.set(model="cnn")
    assert ex.error == "" and ex.view.setting.model == "cnn"
    assert {p: ex.page.rendered[p] - rendered[p] for p in GRADIENT_PANELS} == dict.fromkeys(GRADIENT_PANELS, 0)
    kept = pngs(ex)
    ex.page.forget()  # drawn again from nothing: the same bytes
    ex.set(model="mlp")
    ex.set(model="cnn")
    assert pngs(ex) == kept
