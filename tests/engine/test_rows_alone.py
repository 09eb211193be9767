"""The per-call check of a batched strategy's rows also compares every row with its sample alone by forward mode
(``certify._check_directional`` as a screen: ``vmap`` over the samples of a ``jvp``, the worst row beyond the
tolerance then checked alone by reverse mode). A forward that moves one row by another sample's values without a
cross term (detached), only from 3 samples on, escapes the weighted backward (which shares it) and the one random
sample alone (1/B): it gave a wrong row on every default call before. References: a loop written here."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zoo.nets import DoublyTiedNet, LastSeesPrevious

import pergrad_viz as pv
from pergrad_viz.engine import certify
from pergrad_viz.errors import CheckFailedError


def LastMovedByPrevious() -> nn.Module:  # noqa: N802 (a model's name)
    """From 3 samples on, the last sample's hidden layer adds half the previous sample's, detached."""
    return LastSeesPrevious(detached=True)


def _problem(seed: int):
    torch.manual_seed(seed)
    return LastMovedByPrevious().double(), torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))


def _loop(model, loss_fn, x, y):
    params = list(model.parameters())
    return torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss_fn(model(x[i:i + 1]),
                                                                                      y[i:i + 1]), params)])
                        for i in range(x.shape[0])])


@pytest.mark.parametrize("seed", range(3))
def test_default_per_sample_grads_and_jacobian_equal_the_loop(seed):
    model, x, y = _problem(seed)
    loss_fn = nn.CrossEntropyLoss()
    torch.testing.assert_close(pv.per_sample_grads(model, loss_fn, x, y, flat=True), _loop(model, loss_fn, x, y),
                               rtol=1e-9, atol=1e-12)
    params = list(model.parameters())
    want = torch.stack([torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(o, params,
                                                                                           retain_graph=True)])
                                     for o in model(x[i:i + 1])[0]]) for i in range(x.shape[0])])
    torch.testing.assert_close(pv.per_sample_jacobian(model, x, flat=True), want, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("strategy", ["hooks", "autograd_stack", "batched_grad"])
def test_batched_strategies_asked_for_refuse(strategy):
    model, x, y = _problem(0)
    with pytest.raises(CheckFailedError, match="sample 15"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy=strategy)


def test_no_false_alarm_at_a_tied_embeddings_padding_row(monkeypatch):
    """The backward leaves an Embedding's padding row 0, the forward reads it: with the row tied to an output layer
    a random direction there would part the two modes on every sample with a padding token; the screen's direction
    is 0 on that row, so it passes (no sample is checked alone)."""
    alone = []
    real = certify._check_alone
    monkeypatch.setattr(certify, "_check_alone", lambda *a: alone.append(a[-1]) or real(*a))
    torch.manual_seed(0)
    model, tokens = DoublyTiedNet(vocab=6).double(), torch.randint(0, 6, (8, 7))
    tokens[:, 0] = 1  # the padding index in every sample
    y = torch.randint(0, 6, (8,))
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), tokens, y, strategy="hooks", flat=True)
    assert len(alone) == 1  # the check's one random sample alone, no suspect row
    torch.testing.assert_close(got, _loop(model, nn.CrossEntropyLoss(), tokens, y), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_default_norms_and_clipped_sum_equal_the_loop(seed):
    """The same screen for the results never built as rows: each row's g_i . v formed from the captures."""
    model, x, y = _problem(seed)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    rows = _loop(model, loss_fn, x, y)
    norms = rows.norm(dim=1)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss_fn, x, y), norms, rtol=1e-9, atol=0)
    bound = float(norms.median())
    flat = torch.cat([t.reshape(-1) for t in pv.clipped_grad_sum(model, loss_fn, x, y, bound).values()])
    torch.testing.assert_close(flat, ((bound / (norms + 1e-6)).clamp(max=1)[:, None] * rows).sum(0), rtol=1e-9,
                               atol=1e-12)


class EveryKind(nn.Module):
    """An Embedding with a padding row, a Linear on tokens, packed self-attention, a LayerNorm, a grouped Conv1d with
    'same' padding and a stride-2 Conv1d over the tokens, a ConvTranspose1d, a head tied to the Embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.mix = nn.Linear(8, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.conv = nn.Conv1d(8, 8, 3, padding="same", groups=2)
        self.down = nn.Conv1d(8, 8, 3, stride=2)
        self.up = nn.ConvTranspose1d(8, 8, 2, stride=2)
        self.head = nn.Linear(8, 11)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids)))
        h = self.norm(h + self.attn(h, h, h, need_weights=False)[0])
        c = self.up(torch.tanh(self.down(torch.tanh(self.conv(h.mT)))))
        return self.head(c.mean(2))


@pytest.mark.parametrize("quantity", ["norms", "clipped_sum"])
def test_each_layer_kind_forms_its_rows_dot_the_direction(monkeypatch, quantity):
    """derived/directions.py against the loop's rows: sum over parameters of g_i . v, formed from the captures."""
    from pergrad_viz.engine import combination

    kept = []
    monkeypatch.setattr(combination, "keep_combination", lambda *a: kept.append(a))
    monkeypatch.setattr("pergrad_viz.derived.checked_pass.keep_combination", lambda *a: kept.append(a))  # both paths
    torch.manual_seed(0)
    model = EveryKind().double()
    ids = torch.randint(0, 11, (6, 7))
    ids[:, -1] = 0  # a padding token in every sample
    y = torch.randint(0, 11, (6,))
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    if quantity == "norms":
        pv.per_sample_grad_norms(model, loss_fn, ids, y, strategy="hooks")
    else:
        pv.clipped_grad_sum(model, loss_fn, ids, y, 1.0, strategy="hooks")
    (_, _, _, direction, dots), = kept
    names = [n for n, _ in model.named_parameters()]
    rows = _loop(model, loss_fn, ids, y)
    want = rows @ torch.cat([direction[n].reshape(-1) for n in names])
    got = sum(dots[n] for n in names)
    torch.testing.assert_close(got.double(), want, rtol=1e-9, atol=1e-12)


class WithUnused(LastSeesPrevious):
    """An unused layer: its rows are all 0, so its part of the screen's direction must be 0 (a scale of 1 / 0 made
    every row's excess NaN, and the screen compared nothing)."""

    def __init__(self):
        super().__init__(detached=True)
        self.unused = nn.Linear(3, 3)


@pytest.mark.parametrize("quantity", ["grads", "norms", "clipped_sum"])
def test_the_screen_survives_a_parameter_whose_rows_are_all_zero(quantity):
    torch.manual_seed(0)
    model, x, y = WithUnused().double(), torch.randn(16, 5, dtype=torch.float64), torch.randint(0, 3, (16,))
    call = {"grads": pv.per_sample_grads, "norms": pv.per_sample_grad_norms,
            "clipped_sum": lambda *a, **k: pv.clipped_grad_sum(*a, 1.0, **k)}[quantity]
    with pytest.raises(CheckFailedError, match="sample 15"):
        call(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")


def test_forward_mode_that_cannot_run_the_model_is_not_tried_again(monkeypatch):
    """The CPU's flash attention has no forward-mode formula: the screen's failure is remembered in the plan."""
    from pergrad_viz.engine import forward_mode

    tried = []
    real = forward_mode._loss_along  # the screen's forward mode for a loss
    monkeypatch.setattr(forward_mode, "_loss_along", lambda *a: tried.append(1) or real(*a))

    class Attending(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(4, 12), nn.Linear(4, 3)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.out(nn.functional.scaled_dot_product_attention(q, k, v).mean(1))

    torch.manual_seed(0)
    model, x, y = Attending(), torch.randn(8, 5, 4), torch.randint(0, 3, (8,))
    for _ in range(3):  # the first 2 calls are checked
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
    assert len(tried) == 1


def test_quiet_keeps_only_its_own_threads_warnings_quiet():
    import threading
    import warnings

    from pergrad_viz.core.process import quiet

    shown = []
    real = warnings.showwarning
    warnings.showwarning = lambda message, *a, **k: shown.append(str(message))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            with quiet():
                warnings.warn("ours", stacklevel=1)
                other = threading.Thread(target=lambda: warnings.warn("another thread's", stacklevel=1))
                other.start()
                other.join()
    finally:
        warnings.showwarning = real
    assert shown == ["another thread's"]


def test_a_loss_forward_mode_cannot_run_does_not_switch_the_screen_off_for_other_losses():
    """Remembered per loss and batch size: a boolean-masked loss (no vmap) on 2 samples, then cross-entropy on 16."""

    def masked_ce(out, y):
        keep = y != -100
        return nn.functional.cross_entropy(out[keep], y[keep], reduction="sum") / max(int(keep.sum()), 1)

    model, x, y = _problem(0)
    pv.per_sample_grads(model, masked_ce, x[:2], y[:2], strategy="hooks")  # 2 samples: the coupling is off
    with pytest.raises(CheckFailedError, match="sample 15"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")


def test_a_warning_made_an_error_does_not_switch_the_screen_off(monkeypatch):
    """A warning inside forward mode (its first use warns that torch.jit.script is deprecated) that the user's
    filters make an error stops that call's screen only: the next checked call's runs."""
    import warnings

    from pergrad_viz.engine import forward_mode

    real = forward_mode._loss_along  # the screen's forward mode for a loss

    def warning(*args):
        warnings.warn("a note on the way", FutureWarning, stacklevel=1)
        return real(*args)

    monkeypatch.setattr(forward_mode, "_loss_along", warning)
    model, x, y = _problem(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")
        except CheckFailedError:
            pass  # the one sample alone drew row 15 (1 in 16)
    with pytest.raises(CheckFailedError, match="sample 15"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks")  # a plan's 2nd call: checked
