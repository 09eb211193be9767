"""A call counter in a forward (``self.calls += 1``) or a step number the training loop sets (``model.step = k``)
no longer makes every call probe the model again (pergrad_viz.engine.volatile): once two probes found the same plan,
the number is left out of the key. Every call still equals the loop (each sample alone), also where a later value of
such a number changes the forward's structure; a bool flag or a number that changes the plan is never left out."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_dict_close, counting_calls, ref_grads
from torch import nn

import pergrad_viz as pv
from pergrad_viz.engine import probe, volatile


class Counting(nn.Module):
    """A call counter that does not change what the forward computes."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.net(x)


class Stepped(Counting):
    """The training loop sets ``step``; the forward scales by it (a value), and from step 6 on uses a second layer
    (a structure); ``repeats`` applies the first layer that many more times; ``flip`` (a bool) negates."""

    def __init__(self):
        super().__init__()
        self.extra = nn.Linear(3, 3)
        self.step, self.repeats, self.flip = 0, 0, False

    def forward(self, x):
        h = self.net[0](x)
        for _ in range(self.repeats):
            h = self.net[0](h[:, :4])
        out = self.net[2](self.net[1](h)) / (1.0 + self.step)
        out = self.extra(out) if self.step >= 6 else out
        return -out if self.flip else out


@pytest.fixture
def probes(monkeypatch):
    return counting_calls(monkeypatch, probe, "_make_plan")


def _calls(model: nn.Module, n: int, strategy: str = "auto", **setting) -> None:
    """``n`` calls, the attributes ``setting`` {name: function of k} set before call k, each compared with the
    loop."""
    torch.manual_seed(0)
    loss_fn = nn.CrossEntropyLoss()
    for k in range(n):
        for name, value in setting.items():
            setattr(model, name, value(k))
        x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
        got = pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)
        assert_dict_close(got, ref_grads(model, loss_fn, x, y), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["auto", "hooks"])
def test_a_call_counter_stops_the_probes(probes, strategy):
    _calls(Counting().double(), 8, strategy)
    assert len(probes) == 3  # the first probe and the two that found the same plan


def test_a_step_number_set_by_the_loop_is_left_out_and_its_later_structure_still_right(probes):
    """Steps 0-2 probe (then ``step`` is left out); step 6 brings the extra layer: the plan does not fit, auto
    hands over (the loop's rows) and ``step`` counts again; steps 7-9 probe the new structure, then it is left out
    again."""
    model = Stepped().double()
    _calls(model, 12, step=lambda k: k)
    assert len(probes) == 6
    assert volatile.skipped(model) == {"": frozenset({"step"})}


@pytest.mark.parametrize("setting", [{"repeats": lambda k: k % 3}, {"flip": lambda k: k % 2 == 0}],
                         ids=["a number that changes the plan", "a bool"])
def test_what_changes_the_plan_and_bools_are_never_left_out(probes, setting):
    model = Stepped().double()
    _calls(model, 6, **setting)
    assert volatile.skipped(model) == {}
    assert len(probes) == (3 if "repeats" in setting else 2)  # each value probed once: its plan kept under its key
