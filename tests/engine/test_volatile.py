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


class Mixing(nn.Module):
    """Samples mixed through ``h.mean(0)`` scaled by a value the module holds as a tensor: 0 (apart) at first."""

    def __init__(self, kind: str):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
        if kind == "buffer":
            self.register_buffer("mix", torch.tensor(0.0))
        elif kind == "buffer of 20":
            self.register_buffer("mix", torch.zeros(20, 1))
        elif kind == "frozen parameter":
            self.mix = nn.Parameter(torch.tensor(0.0), requires_grad=False)
        else:
            self.mix = torch.tensor(0.0)

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        scale = self.mix if self.mix.dim() == 0 else self.mix[0]
        return self.net[2](h + scale * h.mean(0, keepdim=True))


@pytest.mark.parametrize("kind", ["buffer", "frozen parameter", "tensor attribute"])
@pytest.mark.parametrize("change", ["in place", "replaced"])
def test_a_tensor_value_switching_a_coupling_on_after_warm_up_is_probed_again(probes, kind, change):
    """Found by a probe: a coupling scaled by a buffer that was 0 through the plan's checked first calls, set to 0.5
    later, gave rows 0.24 off the loop on every call (the key saw no change; the sampled check rarely ran). The
    key holds the identity and version of every tensor a module holds untrained, so the change is probed."""
    model = Mixing(kind).double()
    _calls(model, 4)
    with torch.no_grad():
        if change == "in place":
            model.mix.fill_(0.5)
        elif kind == "buffer":
            model.mix = torch.tensor(0.5, dtype=torch.float64)  # assigned to a buffer's name: still a buffer
        else:
            model.mix = type(model.mix)(torch.tensor(0.5, dtype=torch.float64), requires_grad=False) \
                if kind == "frozen parameter" else torch.tensor(0.5, dtype=torch.float64)
    before = len(probes)
    _calls(model, 3)
    assert len(probes) == before + 1
    with torch.no_grad():
        model.mix.zero_()
    for _ in range(4):  # the DP sum's own plan, its first calls apart
        _clipped_sum_matches(model)
    with torch.no_grad():
        model.mix.fill_(0.5)
    _clipped_sum_matches(model)


def _clipped_sum_matches(model: nn.Module) -> None:
    """``pv.clipped_grad_sum`` (auto) equals the loop's rows clipped and summed."""
    torch.manual_seed(1)
    loss_fn, x, y = nn.CrossEntropyLoss(reduction="sum"), torch.randn(5, 4, dtype=torch.float64), torch.tensor(
        [0, 1, 2, 0, 1])
    ref = ref_grads(model, loss_fn, x, y)
    c = (0.5 / (torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1) + 1e-6)).clamp(max=1.0)
    assert_dict_close(pv.clipped_grad_sum(model, loss_fn, x, y, 0.5),
                      {n: torch.einsum("b,b...->...", c, g) for n, g in ref.items()}, rtol=1e-9, atol=1e-12)


class CountingTensor(Counting):
    """A call counter kept as a tensor attribute, made anew by every forward (a buffer written there is refused)."""

    def __init__(self):
        super().__init__()
        self.seen = torch.zeros((), dtype=torch.int64)

    def forward(self, x):
        self.seen = self.seen + 1
        return self.net(x)


def test_a_tensor_made_by_every_forward_stops_the_probes(probes):
    model = CountingTensor().double()
    _calls(model, 8)
    assert len(probes) <= 3  # the first probe and at most two that found the same plan
    probed = len(probes)
    _calls(model, 4)
    assert len(probes) == probed


@pytest.mark.parametrize("kind", ["buffer", "buffer of 20"])
def test_a_tensor_written_every_step_counts_by_its_value(probes, kind):
    """Found by a probe: ``mix.fill_(v)`` every step, v = 0 for some steps, then ramped: its version counter changed
    at every call with the plan the same, so it was left out of the key while still 0, and the ramp's coupling went
    unseen (rows 0.08-0.45 off the loop for 150 steps). A tensor on a CPU is keyed by its values (a small one) or a
    digest of them (up to 4096 numbers), as a number attribute is: written with the same values, it changes
    nothing."""
    model = Mixing(kind).double()
    for v in [0.0] * 5 + [0.1, 0.2, 0.3, 0.4]:
        with torch.no_grad():
            model.mix.fill_(v)
        _clipped_sum_matches(model)
    assert len(probes) <= 4  # the first probe, the coupling's, then at most two more before it is left out


class Logging(nn.Module):
    """A forward that logs into a list it holds (feature-logging code), as it runs under vmap too."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        self.seen: list = []

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        self.seen.append(h.detach().norm())
        return self.net[2](h)


@pytest.mark.parametrize("strategy", ["auto", "torch_func"])
def test_a_forward_logging_into_a_list_it_holds_keeps_working(strategy):
    """Found by a review: a tensor that escaped vmap into the model's list made the key's read of it raise on every
    later call. A tensor that cannot be read counts by its identity."""
    _calls(Logging().double(), 5, strategy)


class Pooling(nn.Module):
    """A sequence model whose training loop keeps an EMA buffer of 64 numbers, updated after every step."""

    def __init__(self):
        super().__init__()
        self.conv, self.head = nn.Conv1d(3, 8, 3, padding=1), nn.Linear(8, 3)
        self.register_buffer("ema", torch.zeros(64))

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x)).mean(-1))


def test_a_buffer_written_every_step_with_batches_of_several_lengths_stops_the_probes(probes):
    """Found by a review: with the lengths in rotation, each probe was compared with the model's last plan (another
    length's), so a buffer written every step was never left out: a probe on every call (6x a call). The probe is
    compared with the latest plan whose key differs in numbers alone (the same length)."""
    torch.manual_seed(0)
    model, loss_fn = Pooling().double(), nn.CrossEntropyLoss()
    for k in range(18):
        x, y = torch.randn(4, 3, (5, 6, 7)[k % 3], dtype=torch.float64), torch.randint(0, 3, (4,))
        assert_dict_close(pv.per_sample_grads(model, loss_fn, x, y), ref_grads(model, loss_fn, x, y), rtol=1e-9,
                          atol=1e-12)
        with torch.no_grad():
            model.ema.add_(1.0)
    assert len(probes) <= 9
