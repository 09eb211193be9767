"""Models built to fool a fast path: each either gives exactly the loop's numbers or is refused, never silently wrong.

Each test changes one thing a cached check could miss (hooks, modes, parameters, sizes, sample order) and compares
every strategy with the tests' own loop (float64).
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_state_unchanged, counting_calls, ref_grads, ref_jacobian, snapshot
from torch import nn
from torch.nn.utils import parametrizations

import pergrad_viz as pv
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.engine.observe import draws_random_numbers
from pergrad_viz.strategies import hooks

ALL = (*pv.STRATEGIES, "auto")
RTOL, ATOL = 1e-10, 1e-12


def agree_or_refuse(model, loss, x, y, strategy, *, jacobian=True) -> bool:
    """True when ``strategy`` equals the loop (gradients and Jacobians); False when it refused clearly."""
    before = snapshot(model)
    try:
        got = pv.per_sample_grads(model, loss, x, y, strategy=strategy)
        got_j = pv.per_sample_jacobian(model, x, strategy=strategy) if jacobian else None
    except pv.UnsupportedModelError as e:
        assert strategy not in ("auto", "loop"), f"{strategy} refused: {e}"
        assert "strategy=" in str(e) or "'loop'" in str(e), str(e)
        assert_state_unchanged(model, before)
        return False
    assert_state_unchanged(model, before)
    want = ref_grads(model, loss, x, y)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{strategy} {n}: {m}")
    if jacobian:
        for name, w in ref_jacobian(model, x).items():
            torch.testing.assert_close(got_j[name], w, rtol=RTOL, atol=ATOL)
    return True


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def data(b=4):
    torch.manual_seed(1)
    return torch.randn(b, 4, dtype=torch.float64), torch.arange(b) % 3


@pytest.mark.parametrize("strategy", ALL)
def test_a_forward_hook_that_changes_a_layer_output(strategy):
    """A rule assumes output = layer(input); a user's hook that scales it must send that layer to the fallback."""
    model = mlp()
    handle = model[0].register_forward_hook(lambda m, args, out: 2 * out)
    x, y = data()
    try:
        assert agree_or_refuse(model, nn.CrossEntropyLoss(), x, y, strategy)
        if strategy == "hooks":
            assert hooks.describe(Trainable.of(model), x)["0"] == "fallback"
    finally:
        handle.remove()


def _doubled_linear(self, x):
    return 2 * nn.functional.linear(x, self.weight, self.bias)


@pytest.mark.parametrize("strategy", ALL)
def test_a_forward_of_the_instance_s_own(strategy):
    """``layer.forward = ...`` on one Linear: its rule (y = x W^T + b) does not hold, that layer takes the fallback;
    the attribute is the user's and stays."""
    model = mlp()
    own = _doubled_linear.__get__(model[0])
    model[0].forward = own
    x, y = data()
    assert agree_or_refuse(model, nn.CrossEntropyLoss(), x, y, strategy)
    if strategy == "hooks":
        assert hooks.describe(Trainable.of(model), x)["0"] == "fallback"
    assert model[0].forward is own


def test_a_forward_patched_onto_the_class(monkeypatch):
    """``nn.Linear.forward = ...`` after import (some adapters do this): no Linear keeps its rule, even for a model
    whose plan was made before the patch."""
    model = mlp()
    x, y = data()
    assert hooks.describe(Trainable.of(model), x) == {"0": "rule", "2": "rule"}
    monkeypatch.setattr(nn.Linear, "forward", _doubled_linear)
    assert hooks.describe(Trainable.of(model), x) == {"0": "fallback", "2": "fallback"}
    for strategy in ("hooks", "auto"):
        assert agree_or_refuse(model, nn.CrossEntropyLoss(), x, y, strategy)


@pytest.mark.parametrize("strategy", ALL)
def test_a_gradient_hook_on_a_parameter(strategy):
    """The loop's torch.autograd.grad applies p.register_hook; only the loop can, so the others refuse."""
    model = mlp()
    handle = model[2].weight.register_hook(lambda g: 3 * g)
    x, y = data()
    try:
        agreed = agree_or_refuse(model, nn.CrossEntropyLoss(), x, y, strategy)
        assert agreed == (strategy in ("loop", "auto"))
    finally:
        handle.remove()


@pytest.mark.parametrize("strategy", ALL)
def test_weight_norm_parametrization(strategy):
    model = mlp()
    parametrizations.weight_norm(model[0])
    x, y = data()
    assert agree_or_refuse(model, nn.CrossEntropyLoss(), x, y, strategy)


class SequenceFirstOutput(nn.Module):
    """Returns (T, B, C): with T == B a reshape to (B, -1) would silently mix the samples."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # (B, T, 4) -> (T, B, 3)
        return self.fc(x).transpose(0, 1)


@pytest.mark.parametrize("strategy", ALL)
def test_an_output_without_the_batch_first(strategy):
    torch.manual_seed(0)
    model = SequenceFirstOutput().double()
    x = torch.randn(2, 2, 4, dtype=torch.float64)
    loss = lambda o, t: (o.squeeze(1) - t).pow(2).sum()  # noqa: E731  (one sample: (T, 1, 3) vs (T, 3))
    y = torch.randn(2, 2, 3, dtype=torch.float64)
    agreed = agree_or_refuse(model, loss, x, y, strategy)
    assert agreed == (strategy in ("loop", "torch_func", "auto"))


class CentreInTraining(nn.Module):
    """Mixes the samples only in training mode: a plan cached in eval mode must not be reused after .train()."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0) if self.training else h


def test_a_mode_switch_is_seen():
    torch.manual_seed(0)
    model, (x, y) = CentreInTraining().double().eval(), data()
    loss = nn.CrossEntropyLoss()
    assert pv.resolve_strategy("auto", model, x) == "hooks"
    assert agree_or_refuse(model, loss, x, y, "hooks")
    model.train()
    assert pv.resolve_strategy("auto", model, x) == "torch_func"
    assert not agree_or_refuse(model, loss, x, y, "hooks")
    assert agree_or_refuse(model, loss, x, y, "auto")


def test_a_replaced_layer_or_parameter_or_freeze_is_seen():
    model, (x, y) = mlp(), data()
    loss = nn.CrossEntropyLoss()
    assert agree_or_refuse(model, loss, x, y, "hooks")
    model[2] = nn.Bilinear(6, 6, 3).double()  # a new layer: calls with one argument would break it ...
    model[2].forward = lambda h, _m=model[2]: nn.Bilinear.forward(_m, h, h)  # ... so give it one
    assert agree_or_refuse(model, loss, x, y, "hooks")
    model[0].weight = nn.Parameter(torch.randn(6, 4, dtype=torch.float64))
    assert agree_or_refuse(model, loss, x, y, "hooks")
    model[0].weight.requires_grad_(False)
    assert agree_or_refuse(model, loss, x, y, "hooks")


class CentreAfterSixteen(nn.Module):
    """Batch-centring, tested on a batch whose first 16 samples are all the same (a probe must find a different one)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        h = self.fc(x)
        return h - h.mean(0)


def test_samples_that_interact_are_found_past_identical_leading_samples():
    torch.manual_seed(0)
    model = CentreAfterSixteen().double()
    x = torch.cat([torch.ones(17, 4), torch.randn(3, 4)]).double()
    y = torch.arange(20) % 3
    assert pv.resolve_strategy("auto", model, x) == "torch_func"
    for strategy in ("hooks", "autograd_stack", "batched_grad"):
        assert not agree_or_refuse(model, nn.CrossEntropyLoss(reduction="sum"), x, y, strategy, jacobian=False)


def test_batch_of_one_then_more_on_a_shared_layer_output():
    """A learned positional Embedding on arange(T)[None]: (1, T) is batch-first for B = 1 only."""

    class Positional(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(9, 4), nn.Embedding(5, 4), nn.Linear(4, 3)

        def forward(self, idx):
            return self.head(self.tok(idx) + self.pos(torch.arange(idx.shape[1])[None])).mean(1)

    torch.manual_seed(0)
    model = Positional().double()
    x = torch.randint(0, 9, (3, 5))
    y = torch.tensor([0, 1, 2])
    loss = nn.CrossEntropyLoss()
    assert agree_or_refuse(model, loss, x[:1], y[:1], "auto")  # cached at B = 1 ...
    for strategy in ALL:  # ... must not be reused at B = 3
        agree_or_refuse(model, loss, x, y, strategy)
    assert pv.resolve_strategy("auto", model, x) == "hooks"  # its (1, T, 4) output spread: engine.broadcast


class SequenceFirstLSTM(nn.Module):
    """nn.LSTM with the default batch_first=False on (T, B, in), its state passed by keyword."""

    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(3, 4, num_layers=2)
        self.head = nn.Linear(4, 2)

    def forward(self, x):  # (B, T, 3)
        xt = x.transpose(0, 1)
        h0 = torch.zeros(2, x.shape[0], 4, dtype=x.dtype) + 0.1 * x[:, 0, :1].T.unsqueeze(-1)  # per-sample h0
        out, (h_n, _) = self.lstm(xt, hx=(h0, torch.zeros_like(h0)))
        return self.head(out[-1] + h_n[0])


@pytest.mark.parametrize("strategy", ALL)
def test_a_sequence_first_lstm_with_its_state_by_keyword(strategy):
    torch.manual_seed(0)
    model = SequenceFirstLSTM().double()
    x, y = torch.randn(2, 2, 3, dtype=torch.float64), torch.tensor([0, 1])  # T == B
    assert agree_or_refuse(model, nn.CrossEntropyLoss(), x, y, strategy)
    if strategy == "hooks":
        assert hooks.describe(Trainable.of(model), x) == {"lstm": "call", "head": "rule"}


class TupleOutput(nn.Module):
    """Returns (logits, auxiliary): the loss reads both (as many real models do)."""

    def __init__(self):
        super().__init__()
        self.fc, self.aux = nn.Linear(4, 3), nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x), self.aux(x)


def tuple_loss(output, target):
    return nn.functional.cross_entropy(output[0], target) + output[1].pow(2).sum()


class Select(nn.Module):
    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, out):
        return out[self.k]


@pytest.mark.parametrize("strategy", ALL)
def test_a_model_returning_a_tuple(strategy):
    torch.manual_seed(0)
    model, (x, y) = TupleOutput().double(), data()
    assert agree_or_refuse(model, tuple_loss, x, y, strategy, jacobian=False)
    with pytest.raises(TypeError, match="returns a tuple: say which tensor with output="):
        pv.per_sample_jacobian(model, x, strategy=strategy)
    first = pv.per_sample_jacobian(model, x, strategy=strategy, output=lambda out: out[0])
    want = ref_jacobian(nn.Sequential(model, Select(0)), x)
    for name, w in want.items():
        torch.testing.assert_close(first[name.removeprefix("0.")], w, rtol=1e-6, atol=1e-9)


class Checkpointed(nn.Module):
    """Activation checkpointing: torch.func cannot run it, so auto must not pick torch_func blindly."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.a, self.b, self.reentrant = nn.Linear(4, 5), nn.Linear(5, 3), reentrant

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.a(t)), x, use_reentrant=self.reentrant)
        return self.b(h - h.mean(0) if self.training else h)  # mixes samples in training: auto avoids hooks


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing(reentrant):
    torch.manual_seed(0)
    model, (x, y) = Checkpointed(reentrant).double().eval(), data()
    loss = nn.CrossEntropyLoss()
    if reentrant:  # on inputs without grad: PyTorch gives the checkpointed layer nothing; every strategy refuses
        for strategy in ("auto", "hooks", "loop", "autograd_stack", "torch_func"):
            with pytest.raises(pv.UnsupportedModelError, match="use_reentrant=False"):
                pv.per_sample_grads(model, loss, x, y, strategy=strategy)
        return
    for strategy in ("auto", "hooks", "loop", "autograd_stack"):
        assert agree_or_refuse(model, loss, x, y, strategy, jacobian=False)
    model.train()  # samples interact: auto resolves to torch_func, which cannot run a checkpoint: the loop answers
    assert pv.resolve_strategy("auto", model, x) == "torch_func"
    assert agree_or_refuse(model, loss, x, y, "auto", jacobian=False)
    want = torch.stack([g.flatten(1).square().sum(1) for g in ref_grads(model, loss, x, y).values()]).sum(0).sqrt()
    torch.testing.assert_close(pv.per_sample_grad_norms(model, loss, x, y), want, rtol=RTOL, atol=ATOL)


class SamplesAlongTheLength(nn.Module):
    """A Conv1d (kernel 1) on (T, C, B): the samples along the length of the convolution. Its rule is not
    position-wise (it needs the samples first), so that layer takes the per-layer fallback."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 5, kernel_size=1)
        self.head = nn.Linear(5, 3)

    def forward(self, x):  # (B, T, 4)
        h = self.conv(x.permute(1, 2, 0))  # (T, 5, B)
        return self.head(torch.tanh(h).permute(2, 0, 1).mean(1))


@pytest.mark.parametrize("strategy", ALL)
def test_position_wise_rules_take_the_samples_on_any_leading_dimension(strategy):
    """Sequence-first tensors (PyTorch's default for transformers): Embedding, Linear and LayerNorm keep their rules
    with the samples on dimension 1; a layer whose rule is not position-wise (a convolution) does not."""
    from zoo.cases import SequenceFirstTransformer

    torch.manual_seed(0)
    model = SequenceFirstTransformer().double().eval()
    x = torch.randint(1, 9, (4, 5))
    y = torch.arange(4) % 3
    kinds = hooks.describe(Trainable.of(model), x)
    assert set(kinds.values()) == {"rule", "call"}, kinds
    assert agree_or_refuse(model, nn.CrossEntropyLoss(), x, y, strategy)
    model = SamplesAlongTheLength().double()
    x, y = torch.randn(3, 2, 4, dtype=torch.float64), torch.tensor([0, 2, 1])
    if strategy == "hooks":
        assert hooks.describe(Trainable.of(model), x) == {"conv": "fallback", "head": "rule"}
    assert agree_or_refuse(model, nn.CrossEntropyLoss(), x, y, strategy)


# ------------------------------------------------------------------------- which seeded kernels draw


@pytest.mark.parametrize(("op", "values", "draws"), [
    # an RNN on CUDA runs cuDNN's kernel, tagged seeded for its dropout between layers; at dropout=0 it draws nothing
    ("_cudnn_rnn", {"dropout": 0.0, "train": True}, False),
    ("_cudnn_rnn", {"dropout": 0.5, "train": True}, True),
    ("_cudnn_rnn", {"dropout": 0.5, "train": False}, False),
    ("miopen_rnn", {"dropout": 0.0, "train": True}, False),
    ("native_dropout", {"p": 0.0, "train": True}, False),
    ("native_dropout", {"p": 0.1, "train": True}, True),
    ("native_dropout", {"p": 0.1, "train": False}, False),
    ("_scaled_dot_product_efficient_attention", {"dropout_p": 0.0}, False),
    ("_scaled_dot_product_efficient_attention", {"dropout_p": 0.1}, True),
    ("rrelu_with_noise", {"training": False}, False),
    ("rrelu_with_noise", {"training": True}, True),
])
def test_which_seeded_kernels_draw(op, values, draws):
    """The probe's test for a random forward reads each seeded kernel's arguments (no GPU needed: only the schema)."""
    func = getattr(torch.ops.aten, op).default
    assert torch.Tag.nondeterministic_seeded in func.tags
    assert draws_random_numbers(func, (), values) is draws


class _Routed(torch.nn.Module):
    """Rows chosen by the data: samples whose first feature is positive through ``a``, the others through ``b``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)

    def forward(self, x):
        keep = x[:, 0] > 0
        out = torch.zeros(x.shape[0], 3, dtype=x.dtype)
        out[keep] = self.a(x[keep])
        out[~keep] = self.b(x[~keep])
        return out


def test_rows_the_data_selects_are_named_as_such():
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    x[:, 0] = torch.tensor([1.0, -1, 1, 1, -1, 1])
    with pytest.raises(pv.UnsupportedModelError, match=r"\(1, 4\) for one sample, \(0, 4\) for another.*x\[mask\]"):
        pv.per_sample_grads(_Routed(), torch.nn.CrossEntropyLoss(), x, y, strategy="hooks")
    x[:, 0] = 1.0  # no sample for b
    with pytest.raises(pv.UnsupportedModelError, match=r"layer 'b' \(Linear\) gets no rows of the batch"):
        pv.per_sample_grads(_Routed(), torch.nn.CrossEntropyLoss(), x, y, strategy="hooks")
    got = pv.per_sample_grads(_Routed(), torch.nn.CrossEntropyLoss(), x, y)  # auto: each sample alone
    assert got["b.weight"].abs().max() == 0 and got["a.weight"].abs().max() > 0


class _Tokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mix, self.head = nn.Embedding(20, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, ids):  # (B, T) ids of any length T
        return self.head(torch.tanh(self.mix(self.embed(ids))).mean(1))


def test_a_plan_per_sequence_length_is_kept_not_probed_again_at_each_change(monkeypatch):
    """Found by a probe: with batches padded to their longest sequence (DataCollatorWithPadding) the length changed
    at almost every step and each change probed the model again (one plan kept per model): 35 probes in 40 steps,
    a DP step 9.3x a plain one, also for lengths seen before. Now a plan per input signature is kept (up to
    probe.PLANS_PER_MODEL), each length probed once; the numbers stay the loop's."""
    from pergrad_viz.engine import probe

    made = counting_calls(monkeypatch, probe, "_make_plan")
    torch.manual_seed(0)
    model, loss_fn = _Tokens(), nn.CrossEntropyLoss()
    lengths = [5, 7, 5, 9, 7, 5, 9, 7]
    batches = [(torch.randint(0, 20, (4, t)), torch.randint(0, 3, (4,))) for t in lengths]
    for rounds in range(2):
        for ids, y in batches:
            got = pv.per_sample_grads(model, loss_fn, ids, y, verify=False)
            for name, want in ref_grads(model, loss_fn, ids, y).items():
                torch.testing.assert_close(got[name], want)
        assert len(made) == 3, (rounds, len(made))  # one probe per length, none in the second round
