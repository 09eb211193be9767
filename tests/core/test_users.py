"""The user's own errors (the model's, the loss's) shown as the user's own (core/users.py): the same error once, no
frame of the package in its traceback, no chained retry, a note on the inputs, and the fix for common mistakes."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.tutorial.networks import MLP

PACKAGE = pv.__file__.rsplit("/", 1)[0] + "/"
STRATEGIES = ["auto", *pv.STRATEGIES]


def _raised(strategy: str, x: torch.Tensor, y: torch.Tensor, loss=None) -> BaseException:
    torch.manual_seed(0)
    with pytest.raises(Exception) as info:
        pv.per_sample_grads(MLP(784, 20, 10), loss or nn.CrossEntropyLoss(), x, y, strategy=strategy)
    return info.value


def _frames(error: BaseException) -> list[str]:
    return [frame.filename for frame in traceback.extract_tb(error.__traceback__)]


def _notes(error: BaseException) -> str:
    return "\n".join(getattr(error, "__notes__", []))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_target_of_shape_b_1_for_cross_entropy_is_the_users_error_with_its_fix(strategy):
    error = _raised(strategy, torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8, 1)))
    assert isinstance(error, (RuntimeError, AssertionError, ValueError))
    assert not pv.errors.__name__ == type(error).__module__
    assert not [f for f in _frames(error) if f.startswith(PACKAGE)], _frames(error)
    assert error.__context__ is None or error.__suppress_context__, "one error, not a chain of retries"
    assert "targets.squeeze(1)" in _notes(error)
    assert "(8, 1, 28, 28) float32" in _notes(error)


@pytest.mark.parametrize("call", ["grads", "clipped_grad_sum"])
@pytest.mark.parametrize("strategy", ["auto", "torch_func", "loop"])
def test_a_loss_check_behind_a_data_dependent_branch_is_the_losss_own_error(strategy, call):
    def loss_fn(out, y):  # under vmap the branch itself fails (data-dependent control flow), hiding this message
        if bool((y < 0).any()):
            raise ValueError("labels must be class indices >= 0")
        return nn.functional.cross_entropy(out, y, reduction="sum")

    x, y = torch.randn(4, 1, 28, 28), torch.tensor([-3, 1, 2, 0])  # torch_func runs sample 0 alone to tell
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="labels must be class indices >= 0") as info:
        if call == "grads":
            pv.per_sample_grads(MLP(784, 20, 10), loss_fn, x, y, strategy=strategy)
        else:
            pv.clipped_grad_sum(MLP(784, 20, 10), loss_fn, x, y, 1.0, strategy=strategy)
    assert "vmap" not in str(info.value)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_integer_inputs_to_a_float_model_name_the_fix(strategy):
    error = _raised(strategy, torch.randint(0, 3, (8, 1, 28, 28)), torch.randint(0, 10, (8,)))
    assert not [f for f in _frames(error) if f.startswith(PACKAGE)]
    assert ".float()" in _notes(error) and "int64" in _notes(error)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_wrong_feature_size_is_raised_once_with_the_inputs_shapes(strategy):
    error = _raised(strategy, torch.randn(8, 1, 28, 27), torch.randint(0, 10, (8,)))
    assert "shapes cannot be multiplied" in str(error)
    assert "(8, 1, 28, 27)" in _notes(error)
    assert _notes(error).count("pergrad_viz:") == 1  # noted once, though strategies hand over
    assert not [f for f in _frames(error) if f.startswith(PACKAGE)]


def test_the_package_own_errors_keep_their_messages_and_no_note():
    with pytest.raises(pv.UnsupportedModelError) as info:
        pv.per_sample_grads(nn.Sequential(nn.Linear(4, 2), nn.BatchNorm1d(2)), nn.MSELoss(), torch.randn(4, 4),
                            torch.randn(4, 2))
    assert "eval" in str(info.value) and not _notes(info.value)


class CachedBias(nn.Module):
    """Keeps a tensor computed from its parameter across calls in eval mode (timm's LeViT attention_bias_cache)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.table = nn.Parameter(torch.randn(3))
        self.cache: dict[str, torch.Tensor] = {}

    def forward(self, x):
        if self.training:
            return self.fc(x) + self.table.exp()
        if "bias" not in self.cache:
            self.cache["bias"] = self.table.exp()  # ExpBackward keeps its result: freed by a backward
        return self.fc(x) + self.cache["bias"]


@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func", "loop"])
@pytest.mark.parametrize("call", ["per_sample_grads", "clipped_grad_sum"])
def test_a_tensor_cached_across_forwards_is_refused_naming_the_fix(call, strategy):
    """torch.func gave zeros for the cached parameter before (the cache holds the parameter's own graph, not the
    functional one's), and the loop autograd's error of a second backward through a freed graph."""
    torch.manual_seed(0)
    model, x, y = CachedBias().eval(), torch.randn(6, 4), torch.randint(0, 3, (6,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    args = (1.0,) if call == "clipped_grad_sum" else ()
    with pytest.raises((pv.errors.UndefinedPerSampleError, RuntimeError)) as info:
        getattr(pv, call)(model, loss, x, y, *args, strategy=strategy)
    text = str(info.value) + _notes(info.value)
    assert "table" in text or "freed" in text
    assert "get_attention_biases" in text and "every time" in text


def test_a_tensor_derived_in_this_forward_is_not_refused():
    torch.manual_seed(0)
    model, x, y = CachedBias().train(), torch.randn(6, 4), torch.randint(0, 3, (6,))
    loss = nn.CrossEntropyLoss(reduction="sum")
    got = pv.per_sample_grads(model, loss, x, y)["table"]
    want = torch.stack([torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]), [model.table])[0] for i in range(6)])
    torch.testing.assert_close(got, want)


class _SharedMask(nn.Module):
    """A (T, T) attention mask shared by every sample, passed beside the (B, T, d) input."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(6, 6), nn.Linear(6, 4)

    def forward(self, h, mask):
        weights = torch.softmax(self.q(h) @ h.transpose(1, 2) + mask, -1)
        return self.out((weights @ h).mean(1))


@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func"])
def test_a_shared_square_mask_as_long_as_the_batch_names_the_cut(strategy):
    """T == B: the mask has the batch size first and is cut like the samples (the definition); a forward that then
    fails keeps its own error, with a note that names the mask and what to do with a shared tensor."""
    torch.manual_seed(0)
    h, y = torch.randn(5, 5, 6), torch.randint(0, 4, (5,))
    mask = torch.triu(torch.full((5, 5), -1e9), 1)
    with pytest.raises(RuntimeError) as info:
        pv.per_sample_grads(_SharedMask(), nn.CrossEntropyLoss(), (h, mask), y, strategy=strategy)
    notes = _notes(info.value)
    assert "'inputs[1]' has the batch size (5) first" in notes and "keep it in the model" in notes
    assert "two samples (the probe)" in notes


class _Bag(nn.Module):
    """PyTorch's text-classification tutorial model: flat token ids with offsets, not batch-first."""

    def __init__(self):
        super().__init__()
        self.bag, self.head = nn.EmbeddingBag(6, 4, mode="sum"), nn.Linear(4, 3)

    def forward(self, flat, offsets):
        return self.head(self.bag(flat, offsets))


@pytest.mark.parametrize("call", ["grads", "clipped_sum"])
def test_a_per_sample_input_that_is_not_batch_first_is_named(call):
    """Found by a probe: EmbeddingBag(flat, offsets) failed with PyTorch's own offsets error and no word on the cut."""
    flat, offsets, y = torch.tensor([1, 2, 3, 0, 4, 5, 5, 1]), torch.tensor([0, 3, 4, 6]), torch.tensor([0, 1, 2, 1])
    run = {"grads": lambda: pv.per_sample_grads(_Bag(), nn.CrossEntropyLoss(), (flat, offsets), y),
           "clipped_sum": lambda: pv.clipped_grad_sum(_Bag(), nn.CrossEntropyLoss(), (flat, offsets), y, 1.0)}
    with pytest.raises(RuntimeError, match="offsets") as info:
        run[call]()
    notes = _notes(info.value)
    assert "B = 4, and 'inputs[0]' (first dimension not 4) went whole" in notes and "padded (B, L) ids" in notes


class _StateGiven(nn.Module):
    """A GRU whose initial state (layers, B, H) is an input: the samples along its dimension 1."""

    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.GRU(3, 4, num_layers=2, batch_first=True), nn.Linear(4, 2)

    def forward(self, x, h0):
        return self.fc(self.rnn(x, h0)[0][:, -1])


class _Context(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, ctx, x):
        return self.b(torch.tanh(self.a(x) + self.a(ctx)))


def test_samples_along_dimension_1_or_behind_a_broadcast_first_input_are_named():
    """Found by a probe: an RNN's (layers, B, H) state as an input, and a (1, F) context first without targets (B read
    as 1), ended in PyTorch's own shape errors with a note that did not say which layout to change."""
    x, h0, y = torch.randn(4, 5, 3), torch.randn(2, 4, 4), torch.tensor([0, 1, 1, 0])
    with pytest.raises(RuntimeError, match="hidden size") as info:
        pv.per_sample_grads(_StateGiven(), nn.CrossEntropyLoss(), (x, h0), y)
    assert "'inputs[1]' (2, 4, 4) has the samples along dimension 1" in _notes(info.value)
    with pytest.raises(RuntimeError, match="size of tensor") as info:
        pv.per_sample_jacobian(_Context(), (torch.randn(1, 4), torch.randn(5, 4)))
    assert "targets=None, so B was read from the first input tensor: put the samples' tensor first" in \
        _notes(info.value)


def _message_and_notes(call) -> str:
    try:
        call()
    except Exception as e:  # the user's own error, its notes added
        return str(e) + " | " + " | ".join(getattr(e, "__notes__", ()))
    raise AssertionError("no error")


def test_newcomers_mistakes_get_a_note_naming_the_fix():
    """Found by a newcomer's probe: a DataLoader batch [x, y] as inputs, float class indices; a strategy's typo."""
    torch.manual_seed(0)
    model, loss = MLP(784, 20, 10), nn.CrossEntropyLoss()
    x, y = torch.randn(8, 784), torch.randint(0, 10, (8,))
    assert "inputs=x, targets=y" in _message_and_notes(lambda: pv.per_sample_grads(model, loss, [x, y], y))
    assert "targets.long()" in _message_and_notes(lambda: pv.per_sample_grads(model, loss, x, y.float()))
    with pytest.raises(ValueError, match="did you mean 'hooks'"):
        pv.per_sample_grads(model, loss, x, y, strategy="hook")


def test_more_newcomers_mistakes_name_the_fix():
    """Found by a newcomer's probe: one sample without its batch dimension, the loss and the model swapped, a bound of
    None without per_layer."""
    torch.manual_seed(0)
    model, loss = MLP(784, 20, 10), nn.CrossEntropyLoss()
    x, y = torch.randn(8, 784), torch.randint(0, 10, (8,))
    with pytest.raises(ValueError, match=r"without its batch dimension\? pass x\[i:i\+1\]"):
        pv.per_sample_grads(model, loss, x[0], y[:1])
    with pytest.raises(TypeError, match=r"model is a loss \(CrossEntropyLoss\).*the model first"):
        pv.per_sample_grads(loss, model, x, y)
    with pytest.raises(ValueError, match=r"None only with a per_layer"):
        pv.clipped_grad_sum(model, loss, x, y, None)


class _TakesTheDict(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2)

    def forward(self, d):
        return self.lin(d["x"] * d["z"])


def test_a_dict_for_a_model_that_takes_the_dict_itself_names_the_tuple():
    """Found by a probe: forward(self, d) on a dict input failed with 'unexpected keyword argument' and no word on
    the convention; the named fix (inputs=(d,)) gives the loop's rows."""
    torch.manual_seed(0)
    model, y = _TakesTheDict(), torch.tensor([0, 1, 1, 0])
    d = {"x": torch.randn(4, 3), "z": torch.randn(4, 3)}
    with pytest.raises(TypeError, match="unexpected keyword") as info:
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), d, y)
    assert "pass it inside a tuple: inputs=(d,)" in _notes(info.value)
    got = pv.per_sample_grads(model, nn.CrossEntropyLoss(), (d,), y)
    for i in range(4):
        one = {k: v[i:i + 1] for k, v in d.items()}
        want = torch.autograd.grad(nn.CrossEntropyLoss()(model(one), y[i:i + 1]), model.lin.weight)[0]
        torch.testing.assert_close(got["lin.weight"][i], want)


class _SharedVector(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x, v):
        return self.lin(x * v)


def test_a_shared_vector_as_long_as_the_batch_is_the_one_named():
    """Found by a probe: model(x (4, 4), v (4,)) with v shared and B = 4: the note named the samples' x as maybe
    shared, not v."""
    torch.manual_seed(0)
    x, v, y = torch.randn(4, 4), torch.randn(4), torch.tensor([0, 1, 1, 0])
    with pytest.raises(RuntimeError) as info:
        pv.per_sample_grads(_SharedVector(), nn.CrossEntropyLoss(), (x, v), y, strategy="hooks")
    assert "'inputs[1]' has the batch size (4) first" in _notes(info.value)


class _TwoOutputs(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        out = self.lin(x)
        return (out, out.detach()) if self.kind == "tuple" else {"logits": out}


class _KeywordsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, **kwargs):
        return self.lin(kwargs["x"])


class _Embeds(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 3)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def test_a_third_round_of_newcomers_mistakes_names_the_fix():
    """Found by a probe of newcomers' mistakes (the model's or the loss's own errors, which had only the note on the
    inputs): one-hot integer targets, a model returning a tuple or a dict into a torch.nn loss, targets=None for a
    loss that needs them, a keyword-only forward given a tensor, token ids as floats."""
    torch.manual_seed(0)
    loss = nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    model = nn.Linear(4, 3)
    one_hot = nn.functional.one_hot(y, 3)
    assert "targets.argmax(1)" in _message_and_notes(lambda: pv.per_sample_grads(model, loss, x, one_hot))
    assert "cross_entropy(out[0], y)" in _message_and_notes(
        lambda: pv.per_sample_grads(_TwoOutputs("tuple"), loss, x, y))
    assert "cross_entropy(out['logits'], y)" in _message_and_notes(
        lambda: pv.per_sample_grads(_TwoOutputs("dict"), loss, x, y))
    assert "pass the targets" in _message_and_notes(lambda: pv.per_sample_grads(model, loss, x, None))
    assert "inputs={'x': x}" in _message_and_notes(lambda: pv.per_sample_grads(_KeywordsOnly(), loss, x, y))
    ids = torch.randint(0, 10, (5, 6)).float()
    assert "'inputs' holds floating-point numbers" in _message_and_notes(
        lambda: pv.per_sample_grads(_Embeds(), loss, ids, y))


class _LstmIntoHead(nn.Module):
    """The classic slip: nn.LSTM's (output, state) handed to a Linear."""

    def __init__(self):
        super().__init__()
        self.rnn, self.head = nn.LSTM(4, 5, batch_first=True), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.rnn(x))


class _CallsItsBlockWrongly(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _KeywordsOnly()  # called with a tensor below

    def forward(self, x):
        return self.block(x)


class _OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.mask = None

    def forward(self, x):
        return torch.mul(self.lin(x), self.mask)


def test_the_loss_hints_stay_off_errors_inside_the_model():
    """Found by a review: the model's own tuple, None and keyword slips inside its forward got the hints for a loss
    given the model's tuple output, for targets=None and for a keyword-only forward, each naming a wrong fix."""
    torch.manual_seed(0)
    loss = nn.CrossEntropyLoss()
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    lstm = _message_and_notes(lambda: pv.per_sample_grads(_LstmIntoHead(), loss, x.view(5, 1, 4), y))
    assert "take [0] of it in the forward" in lstm and "loss_fn=lambda" not in lstm
    inner = _message_and_notes(lambda: pv.per_sample_grads(_CallsItsBlockWrongly(), loss, x, y))
    assert "_KeywordsOnly.forward() takes 1 positional argument" in inner and "inputs={'x': x}" not in inner
    for call in (lambda: pv.per_sample_jacobian(_OptionalMask(), x),
                 lambda: pv.per_sample_grads(_OptionalMask(), lambda out, _: out.sum(), x, None)):
        assert "pass the targets" not in _message_and_notes(call)
    targets = _message_and_notes(lambda: pv.per_sample_grads(nn.Linear(4, 3), loss, x, (y, y)))
    assert "the model returns" not in targets


def test_a_hint_never_fires_on_the_losss_own_signature_nor_replaces_the_error():
    """Found by a review: a loss of one argument (lambda out: ...) got the keyword-only forward's hint; a hint that
    raised while reading the inputs (a sparse input) replaced the user's own error."""
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    one = _message_and_notes(lambda: pv.per_sample_grads(nn.Linear(4, 3), lambda out: out.sum(), x, y))
    assert "takes 1 positional argument" in one and "inputs={'x': x}" not in one

    class FloatIds(nn.Module):  # an Embedding given floats, beside a shared float8 input the hint cannot round
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 3)

        def forward(self, extra, ids):
            return self.emb(ids).mean(1)

    extra = torch.ones(3).to(torch.float8_e4m3fn)  # round() has no float8 kernel
    ids = torch.randint(0, 10, (5, 2)).float()
    message = _message_and_notes(lambda: pv.per_sample_grads(FloatIds(), nn.CrossEntropyLoss(), (extra, ids), y))
    assert "'indices'" in message  # the user's own error, not one raised by the hint
