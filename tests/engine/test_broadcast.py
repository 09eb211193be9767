"""Which path the parameters of shape (1, ...) take (tests/zoo/broadcast.py): the per-sample copies where every use
broadcasts over the batch, the per-layer fallback where a use reads their first dimension; the values of both paths
against the loop are tests/strategies/test_zoo.py's job, and the per-sample copies' own check is tested here by
planting a wrong answer."""

from __future__ import annotations

import pytest
import torch
from helpers import ref_grads
from zoo.broadcast import CASES, PATH, SPREAD

import pergrad_viz as pv
from pergrad_viz.core.batch import Batch
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine import broadcast
from pergrad_viz.engine.capture import describe

BY_NAME = {case.name: case for case in CASES}


def _layer_paths(case, batch: int = 3) -> dict[str, str]:
    model = case.make_model()
    x, _ = case.make_inputs(batch)
    return describe(Trainable.of(model), Batch.of(x))


@pytest.mark.parametrize("name", list(PATH))
def test_each_case_takes_the_path_its_uses_allow(name):
    paths = _layer_paths(BY_NAME[name])
    holder = "" if name.startswith("tokens") else "offset"
    assert paths[holder] == PATH[name], paths


def test_the_copies_give_each_sample_its_own_gradient_at_several_batch_sizes():
    case = BY_NAME["tokens-and-positions"]
    model = case.make_model()
    loss_fn = torch.nn.CrossEntropyLoss()
    for batch in (1, 2, 5):
        x, y = case.make_inputs(batch)
        got = pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
        want = ref_grads(model, loss_fn, x, y)
        for name, g in got.items():
            torch.testing.assert_close(g, want[name], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(("check", "name", "layer", "path"), [
    ("check", "tokens-positions-mean", "", "broadcast"),
    ("check_outputs", "position-embedding-mean", "positions", "rule"),
])
def test_a_check_that_always_passes_would_be_caught_per_call(monkeypatch, check, name, layer, path):
    """Planted bug: the probe's check of the copies says yes to a forward that spreads each row's gradient over the
    batch (``.mean(0, keepdim=True)`` of a parameter, or of a shared layer's output). The per-call check then
    refuses the explicit strategy and ``auto`` still answers the loop's numbers."""
    monkeypatch.setattr(broadcast, check, lambda *a, **k: True)
    case = BY_NAME[name]
    model = case.make_model()
    x, y = case.make_inputs(4)
    loss_fn = torch.nn.CrossEntropyLoss()
    assert describe(Trainable.of(model), Batch.of(x))[layer] == path
    with pytest.raises(pv.UnsupportedModelError, match="per-call check"):
        pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
    got = pv.per_sample_grads(model, loss_fn, x, y)
    want = ref_grads(model, loss_fn, x, y)
    for name, g in got.items():
        torch.testing.assert_close(g, want[name], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", list(SPREAD))
def test_a_shared_position_embedding_takes_its_rule_where_its_output_broadcasts(name):
    """Its output (1, T, D) handed downstream as a per-sample copy: the embedding keeps its own rule; where the
    forward reads that output's first dimension, hooks refuses the model (auto: torch_func)."""
    case = BY_NAME[name]
    x, _ = case.make_inputs(3)
    if SPREAD[name] == "rule":
        assert _layer_paths(case) == {"tokens": "rule", "positions": "rule", "head": "rule"}
        assert pv.resolve_strategy("auto", case.make_model(), x) == "hooks"
    else:
        assert pv.resolve_strategy("auto", case.make_model(), x) == "torch_func"
