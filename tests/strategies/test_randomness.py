"""randomness='different' (issue 27, pergrad_viz.core.randomness): dropout, drop-path and noise left on, each sample's
gradient that of its own loss under the random numbers one batched forward drew for it. References written here: the
same global seed, the same chunks run as plain batched forwards, one autograd.grad per row's loss."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_refuses, assert_state_unchanged, snapshot
from torch import nn
from zoo.random import CASES as RANDOM_CASES

import pergrad_viz as pv
from pergrad_viz.core.randomness import Draws
from pergrad_viz.errors import CheckFailedError, UndefinedPerSampleError

DT = torch.float64
BATCHED = ("auto", "hooks", "autograd_stack", "batched_grad")


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.3), nn.Linear(8, 8), nn.Tanh(),
                                 nn.Dropout(0.2), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)


class DropoutTransformer(nn.Module):
    """nn.TransformerEncoderLayer with its dropout on (inside attention, after it, in the feed-forward)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(self.embed(x)).mean(1))


class AttentionThenDropout(nn.Module):
    """nn.MultiheadAttention without dropout of its own, a Dropout on its output: the layer's own output is (L, B, E)
    in memory (batch_first: a (B, L, E) view of it), so the dropout's mask meets the samples in that order."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Linear(4, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=batch_first)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.embed(x) if self.batch_first else self.embed(x).transpose(0, 1)
        a, _ = self.attention(h, h, h, need_weights=False)
        h = self.drop(a + h)
        return self.head((h if self.batch_first else h.transpose(0, 1)).mean(1))


class BertLogits(nn.Module):
    """A tiny Hugging Face BERT classifier in training mode, its dropout 0.1 on (attention and hidden), as HF trains."""

    def __init__(self):
        super().__init__()
        from transformers import BertConfig, BertForSequenceClassification

        config = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=16, num_labels=3)
        self.bert = BertForSequenceClassification(config)

    def forward(self, ids):
        return self.bert(input_ids=ids).logits


def _bert():
    torch.manual_seed(0)
    return BertLogits().to(DT).train()


def _ids(batch):
    g = torch.Generator().manual_seed(5)
    return torch.randint(0, 40, (batch, 7), generator=g), torch.randint(0, 3, (batch,), generator=g)


def _mlp():
    torch.manual_seed(0)
    return DropoutMLP().to(DT).train()


def _transformer():
    torch.manual_seed(0)
    return DropoutTransformer().to(DT).train()


def _attention(batch_first):
    def make():
        torch.manual_seed(0)
        return AttentionThenDropout(batch_first).to(DT).train()
    return make


def _floats(*shape):
    def make(batch):
        g = torch.Generator().manual_seed(5)
        return torch.randn(batch, *shape, generator=g, dtype=DT), torch.randint(0, 3, (batch,), generator=g)
    return make


CASES = [("dropout-mlp", _mlp, _floats(4), ""), ("dropout-transformer", _transformer, _floats(5, 4), ""),
         ("attention-batch-first-dropout", _attention(True), _floats(5, 4), ""),
         ("attention-sequence-first-dropout", _attention(False), _floats(5, 4), ""),
         ("hf-bert-dropout", _bert, _ids, "transformers"), *RANDOM_CASES]
IDS = [c[0] for c in CASES]
# nn.MultiheadAttention's call rule runs an attention of its own, which draws other masks than the layer's: the check
# sees it, and auto hands over to the loop (from the call's first random state: one forward per sample, in order).
HANDS_OVER = {"dropout-transformer"}


def _problem(case, batch=6):
    name, make_model, make_inputs, needs = case
    if needs:
        pytest.importorskip(needs)
    return make_model(), *make_inputs(batch)


def in_batch_reference(model, loss_fn, x, y, seed, chunk):
    """Per-sample gradients with the masks of plain batched forwards of ``chunk`` rows each, from ``seed``."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(seed)
    rows = []
    for start in range(0, x.shape[0], chunk):
        out = model(x[start:start + chunk])
        for i in range(out.shape[0]):
            g = torch.autograd.grad(loss_fn(out[i:i + 1], y[start + i:start + i + 1]), params, retain_graph=True,
                                    allow_unused=True)
            rows.append([torch.zeros_like(p) if gi is None else gi for gi, p in zip(g, params, strict=True)])
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


@pytest.mark.parametrize("strategy", BATCHED)
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_each_row_is_its_loss_under_the_draws_of_the_batched_forward(case, strategy):
    model, x, y = _problem(case)
    loss = nn.CrossEntropyLoss()
    before = snapshot(model)
    torch.manual_seed(7)
    call = lambda: pv.per_sample_grads(model, loss, x, y, strategy=strategy, randomness="different",  # noqa: E731
                                       chunk_size=4)
    if case[0] in HANDS_OVER and strategy == "hooks":
        with pytest.raises(CheckFailedError):
            call()
        return
    got = call()
    after_call = torch.get_rng_state()
    want = in_batch_reference(model, loss, x, y, seed=7, chunk=1 if case[0] in HANDS_OVER and strategy == "auto"
                              else 4)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-7, atol=1e-9, msg=name)
    assert torch.equal(after_call, torch.get_rng_state()), "the call advances the generator as its forwards do"
    assert_state_unchanged(model, before)


@pytest.mark.parametrize("case", CASES[:2], ids=IDS[:2])
def test_the_loop_draws_each_samples_own_numbers(case):
    model, x, y = _problem(case)
    loss = nn.CrossEntropyLoss()
    torch.manual_seed(3)
    got = pv.per_sample_grads(model, loss, x, y, strategy="loop", randomness="different")
    torch.manual_seed(3)
    want = in_batch_reference(model, loss, x, y, seed=3, chunk=1)  # one sample a forward, in order
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_norms_and_the_clipped_sum_under_the_same_draws(case):
    model, x, y = _problem(case)
    loss = nn.CrossEntropyLoss()
    want = in_batch_reference(model, loss, x, y, seed=11, chunk=1 if case[0] in HANDS_OVER else 6)
    squared = sum(g.flatten(1).square().sum(1) for g in want.values())
    torch.manual_seed(11)
    norms = pv.per_sample_grad_norms(model, loss, x, y, randomness="different")
    torch.testing.assert_close(norms, squared.sqrt(), rtol=1e-7, atol=1e-9)
    factors = (0.5 / (squared.sqrt() + 1e-6)).clamp(max=1.0)
    torch.manual_seed(11)
    sums = pv.clipped_grad_sum(model, loss, x, y, 0.5, randomness="different")
    for name, g in want.items():
        torch.testing.assert_close(sums[name], torch.einsum("b,b...->...", factors, g), rtol=1e-7, atol=1e-9)


def test_hooks_failing_on_draws_it_cannot_replay_names_them_and_the_samples_interacting():
    """The norms' check under randomness='different' compares with the sample in its batch under the same draws, and
    cannot tell the dropout inside nn.MultiheadAttention (which hooks' call rule draws otherwise) from samples that
    interact: it takes the safe side (the batched strategies are refused after it under auto), and says both, with
    the strategies that compute each sample alone under its own draws (it said only that the samples interact, and
    offered torch_func, which randomness='different' refuses)."""
    model, x, y = _problem(CASES[IDS.index("dropout-transformer")])
    torch.manual_seed(5)
    with pytest.raises(CheckFailedError, match=r"cannot tell a layer whose draws .*nn\.MultiheadAttention.* from "
                                               r"samples that interact\. Use strategy='auto' or 'loop'") as info:
        pv.per_sample_grad_norms(model, nn.CrossEntropyLoss(), x, y, strategy="hooks", randomness="different")
    assert "torch_func" not in str(info.value)


def test_dp_step_takes_randomness():
    model, x, y = _problem(CASES[0])
    torch.manual_seed(2)
    pv.dp_step(model, nn.CrossEntropyLoss(), x, y, 1.0, noise_multiplier=0.0, generator=None,
               randomness="different")
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("strategy", ("hooks", "autograd_stack", "batched_grad"))
def test_the_check_draws_the_same_numbers_again(monkeypatch, strategy):
    """Planted: a check that does not replay the strategy's draws compares other masks, and fails; so the check's
    reference really is the batched forward's own draws."""
    model, x, y = _problem(CASES[0], batch=16)
    monkeypatch.setattr(Draws, "replaying", lambda self, rows: torch.random.fork_rng(devices=[]))
    with pytest.raises(CheckFailedError):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy=strategy, randomness="different")


def test_a_wrong_row_is_still_caught(monkeypatch):
    import dataclasses

    from pergrad_viz.strategies import REGISTRY

    real = REGISTRY["hooks"]

    def grads(trainable, loss_fn, inputs, targets, out):
        real.grads(trainable, loss_fn, inputs, targets, out)
        out["net.0.weight"][2].mul_(1.5)

    monkeypatch.setitem(REGISTRY, "hooks", dataclasses.replace(real, grads=grads))
    model, x, y = _problem(CASES[0], batch=16)
    with pytest.raises(CheckFailedError):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="hooks", randomness="different")
    torch.manual_seed(5)
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, randomness="different")  # auto: to the loop
    torch.manual_seed(5)
    want = in_batch_reference(model, nn.CrossEntropyLoss(), x, y, seed=5, chunk=1)
    torch.testing.assert_close(got["net.0.weight"], want["net.0.weight"], rtol=1e-7, atol=1e-9)


def test_torch_func_is_refused_and_auto_never_picks_it():
    model, x, y = _problem(CASES[0])
    assert_refuses(lambda: pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, strategy="torch_func",
                                               randomness="different"), model, "torch_func", "'auto' or 'loop'")


@pytest.mark.parametrize("value", ["same", None, 1, "Different"])
def test_a_bad_value_names_the_choices(value):
    model, x, y = _problem(CASES[0])
    assert_refuses(lambda: pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, randomness=value), model,
                   "'error'", "'different'")


@pytest.mark.parametrize("call", ["grads", "norms", "clipped_sum"])
def test_the_default_refuses_and_names_the_option_without_drawing(call):
    model, x, y = _problem(CASES[0])
    loss = nn.CrossEntropyLoss()
    calls = {"grads": lambda: pv.per_sample_grads(model, loss, x, y),
             "norms": lambda: pv.per_sample_grad_norms(model, loss, x, y),
             "clipped_sum": lambda: pv.clipped_grad_sum(model, loss, x, y, 1.0)}
    torch.manual_seed(9)
    assert_refuses(calls[call], model, "randomness='different'", error=UndefinedPerSampleError)


@pytest.mark.parametrize("call", ["jacobian", "ntk", "scan"])
def test_calls_without_the_option_do_not_name_it(call, tmp_path):
    """Found by a probe: the refusal named randomness='different' to calls that have no such argument."""
    model, x, y = _problem(CASES[0])
    calls = {"jacobian": lambda: pv.per_sample_jacobian(model, x),
             "ntk": lambda: pv.empirical_ntk(model, x),
             "scan": lambda: pv.scan(model, nn.CrossEntropyLoss(), torch.utils.data.TensorDataset(x, y),
                                     out=tmp_path / "scan", batch_size=3)}
    with pytest.raises(UndefinedPerSampleError, match=r"model\.eval\(\)") as info:
        calls[call]()
    assert "randomness=" not in str(info.value)


@pytest.mark.parametrize("quantity", ["grads", "jacobian"])
def test_a_draw_that_ignores_eval_mode_is_named_so(quantity):
    """F.dropout(..., training=True) in a model already in eval mode: model.eval() cannot be the fix."""
    name, make_model, make_inputs, _ = next(c for c in CASES if c[0] == "f-dropout-training-true")
    model, (x, y) = make_model().eval(), make_inputs(6)
    call = (lambda: pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)) if quantity == "grads" else (
        lambda: pv.per_sample_jacobian(model, x))
    with pytest.raises(UndefinedPerSampleError, match=r"eval mode already.*training=self\.training") as info:
        call()
    assert ("randomness='different'" in str(info.value)) == (quantity == "grads")


def test_a_plan_made_under_different_is_not_used_by_a_default_call():
    model, x, y = _problem(CASES[4])  # F.dropout(training=True): no module flag shows it, only the probe
    pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y, randomness="different")
    with pytest.raises(UndefinedPerSampleError):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, y)


def test_functional_dropout_in_the_batched_forward_is_what_the_rows_use():
    """Sanity of the reference itself: two different seeds give different rows (the masks matter)."""
    model, x, y = _problem(CASES[0])
    loss = nn.CrossEntropyLoss()
    a = in_batch_reference(model, loss, x, y, seed=1, chunk=6)
    b = in_batch_reference(model, loss, x, y, seed=2, chunk=6)
    assert not torch.allclose(a["net.0.weight"], b["net.0.weight"])



@pytest.mark.parametrize("call", ["grads", "norms", "clipped_sum", "dp_step"])
def test_a_refusal_after_the_forward_drew_leaves_the_generator_as_it_was(call):
    """Found by a probe: under randomness='different', a refusal raised after a forward (a non-finite sample, a loss
    returning a tuple) left torch's generator advanced by the masks drawn."""
    model, x, y = _problem(CASES[0])
    x = x.clone()
    x[1, 0] = float("nan")
    loss = nn.CrossEntropyLoss()
    tuple_loss = lambda out, t: (loss(out, t), {})  # noqa: E731
    calls = {"grads": lambda: pv.per_sample_grads(model, tuple_loss, x, y, randomness="different"),
             "norms": lambda: pv.per_sample_grad_norms(model, tuple_loss, x, y, randomness="different"),
             "clipped_sum": lambda: pv.clipped_grad_sum(model, loss, x, y, 0.1, randomness="different"),
             "dp_step": lambda: pv.dp_step(model, loss, x, y, 0.1, noise_multiplier=1.0, expected_batch_size=6,
                                           generator=torch.Generator().manual_seed(0), randomness="different")}
    torch.manual_seed(9)
    before = torch.get_rng_state()
    with pytest.raises((ValueError, TypeError)):
        calls[call]()
    assert torch.equal(torch.get_rng_state(), before)
