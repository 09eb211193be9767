"""A plan made before the model's forward changed, by what no plain module attribute shows (a flag in a settings
object as Hugging Face's ``self.config``, an enum member, a global): every call after the switch gives the loop's
numbers (written here), with the per-call check off, so that nothing rests on it being due; an explicit ``hooks``
refuses where the plan cannot see the switch, never zeros for the layer it never saw."""

from __future__ import annotations

import dataclasses
import enum

import pytest
import torch
from helpers import ref_grads, ref_jacobian
from torch import nn

import pergrad_viz as pv

SWITCH = {"extra": False}  # a global: no plan key can read it


class Mode(enum.Enum):
    PLAIN = "plain"
    CENTRED = object()  # not a plain value: the member itself is read


@dataclasses.dataclass
class Settings:
    center: bool = False
    extra: bool = False


class Switched(nn.Module):
    """tanh(a(x)) -> [+ tanh(c(h)) when switched on] -> [minus the batch mean when centring] -> b."""

    def __init__(self, how: str):
        super().__init__()
        self.a, self.c, self.b = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.how, self.config, self.mode = how, Settings(), Mode.PLAIN

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if SWITCH["extra"] if self.how == "global" else self.config.extra:
            h = h + torch.tanh(self.c(h))
        if self.config.center or self.mode is Mode.CENTRED:
            h = h - h.mean(0, keepdim=True)
        return self.b(h)

    def switch(self, what: str) -> None:
        if what == "extra layer":
            SWITCH["extra"] = self.how == "global"
            self.config.extra = self.how == "settings"
        elif what == "centring":
            self.config.center = True
        else:
            self.mode = Mode.CENTRED


def _loop_clipped(model, loss_fn, x, y, bound):
    rows = ref_grads(model, loss_fn, x, y)
    norms = torch.cat([g.flatten(1) for g in rows.values()], 1).norm(dim=1)
    factors = (bound / (norms + 1e-6)).clamp(max=1)
    return {n: torch.einsum("b,b...->...", factors, g) for n, g in rows.items()}, norms


@pytest.fixture(autouse=True)
def _switch_off():
    yield
    SWITCH["extra"] = False


@pytest.mark.parametrize("how,what", [("global", "extra layer"), ("settings", "extra layer"),
                                      ("settings", "centring"), ("settings", "enum")])
def test_every_call_after_a_switch_is_the_loops(how, what):
    torch.manual_seed(0)
    model = Switched(how).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    for _ in range(3):  # plans made and checked before the switch
        pv.per_sample_grads(model, loss_fn, x, y)
        pv.clipped_grad_sum(model, loss_fn, x, y, 0.5)
        pv.per_sample_jacobian(model, x)
    model.switch(what)
    want = ref_grads(model, loss_fn, x, y)
    want_clipped, want_norms = _loop_clipped(model, loss_fn, x, y, 0.5)
    want_jacobian = ref_jacobian(model, x)
    for _ in range(3):
        got = pv.per_sample_grads(model, loss_fn, x, y, verify=False)
        clipped = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, verify=False)
        norms = pv.per_sample_grad_norms(model, loss_fn, x, y, verify=False)
        jacobian = pv.per_sample_jacobian(model, x, verify=False)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(clipped[name], want_clipped[name], rtol=1e-9, atol=1e-12)
            torch.testing.assert_close(jacobian[name], want_jacobian[name], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(norms, want_norms, rtol=1e-9, atol=1e-12)


def test_explicit_hooks_refuses_a_layer_its_plan_never_saw():
    torch.manual_seed(0)
    model = Switched("global").double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks")
    pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, strategy="hooks")
    model.switch("extra layer")
    for call in (lambda: pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", verify=False),
                 lambda: pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, strategy="hooks", verify=False),
                 lambda: pv.per_sample_jacobian(model, x, strategy="hooks", verify=False)):
        with pytest.raises(pv.PlanMismatchError, match=r"parameter 'c\.weight' takes part in this call"):
            call()
    assert all(p.grad is None for p in model.parameters()) and not model.a._forward_hooks


class BatchBranch(nn.Module):
    """A branch the whole batch decides: c runs only where every sample's first feature is above -10."""

    def __init__(self):
        super().__init__()
        self.a, self.c, self.b = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if bool((x[:, 0] > -10).all()):
            h = torch.tanh(self.c(h))
        return self.b(h)


def test_a_layer_the_plan_saw_that_the_batch_skips_is_the_loops():
    """Planned on batches where every sample takes the branch; a batch with one sample that does not skips c for
    all of them, while alone the others would take it: not zeros for c, the loop's numbers (check off)."""
    torch.manual_seed(0)
    model = BatchBranch().double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2])
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    pv.per_sample_grads(model, loss_fn, x, y)
    pv.clipped_grad_sum(model, loss_fn, x, y, 0.5)
    x[0, 0] = -20.0
    want = ref_grads(model, loss_fn, x, y)
    want_clipped, _ = _loop_clipped(model, loss_fn, x, y, 0.5)
    got = pv.per_sample_grads(model, loss_fn, x, y, verify=False)
    clipped = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, verify=False)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(clipped[name], want_clipped[name], rtol=1e-9, atol=1e-12)
    with pytest.raises(pv.PlanMismatchError, match=r"layer 'c' \(Linear\) is called 0 time\(s\), not 1"):
        pv.per_sample_grads(model, loss_fn, x, y, strategy="hooks", verify=False)


class _Trimmed(nn.Module):
    """An LSTM over each batch's ids trimmed to its longest length: torch.func cannot run it (data-dependent length)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.lstm, self.fc = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, ids, lengths):
        h, _ = self.lstm(self.emb(ids[:, :int(lengths.max())]))
        return self.fc(h[:, -1])


def test_a_plan_mismatch_advises_auto_which_runs_where_torch_func_cannot():
    """Found by a probe: hooks' refusal said "Use strategy='torch_func'", which fails on an LSTM; auto runs it."""
    model, loss_fn, y = _Trimmed().double(), nn.CrossEntropyLoss(), torch.tensor([0, 2, 1, 0])
    ids = torch.randint(0, 20, (4, 9), generator=torch.Generator().manual_seed(1))
    pv.per_sample_grads(model, loss_fn, (ids, torch.tensor([9, 9, 9, 9])), y, strategy="hooks")
    lengths = torch.tensor([5, 3, 2, 4])
    with pytest.raises(pv.PlanMismatchError, match=r"Use strategy='auto' \(it switches to strategy='torch_func', or "
                                                   r"to the loop"):
        pv.per_sample_grads(model, loss_fn, (ids, lengths), y, strategy="hooks")
    params = list(model.parameters())
    want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
        loss_fn(model(ids[i:i + 1], lengths[i:i + 1]), y[i:i + 1]), params)]) for i in range(4)])
    got = pv.per_sample_grads(model, loss_fn, (ids, lengths), y, strategy="auto", flat=True)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
