"""Book-keeping of the clipped sum where a weight is tied between layers (an Embedding and an output Linear, two
Linears, two Embeddings, GPT-2's wte / lm_head): each layer keeps its own ghost form (no (B, *weight.shape)
per-sample gradient), the norm of the tied weight is the layers' own plus twice their cross terms, and the sum equals
the definition written plainly here (per-sample autograd.grad of each sample alone, clipped, summed), in float64."""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import assert_state_unchanged, snapshot
from torch import nn

import pergrad_viz as pv
from pergrad_viz.derived import bookkeeping
from pergrad_viz.derived.tied import dense_part, tied_squared_norms
from pergrad_viz.errors import CheckFailedError
from pergrad_viz.rules.linear import instantiating_is_cheaper

os.environ["HF_HUB_OFFLINE"] = "1"
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]
RTOL = 1e-6


def _sample(obj, i: int):
    if isinstance(obj, dict):
        return {k: v[i:i + 1] for k, v in obj.items()}
    return obj[i:i + 1]


def loop_clipped_sum(model, loss_fn, x, y, bound):
    """Per sample: the gradient of its loss alone, scaled by min(1, C / (norm + 1e-6)); summed. Also the norms."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    total = {n: torch.zeros_like(p) for n, p in named}
    norms = []
    for i in range(y.shape[0]):
        xi = _sample(x, i)
        out = model(**xi) if isinstance(xi, dict) else model(xi)
        grads = torch.autograd.grad(loss_fn(out, y[i:i + 1]), [p for _, p in named], allow_unused=True)
        g = [torch.zeros_like(p) if gi is None else gi for gi, (_, p) in zip(grads, named, strict=True)]
        norm = math.sqrt(sum(float(t.square().sum()) for t in g))
        norms.append(norm)
        for (n, _), gi in zip(named, g, strict=True):
            total[n] += min(1.0, bound / (norm + 1e-6)) * gi
    return total, torch.tensor(norms, dtype=torch.float64)


def check(model, loss_fn, x, y, **kw):
    """The clipped sum at a bound that clips about half of the samples equals the loop's; the model left alone."""
    _, norms = loop_clipped_sum(model, loss_fn, x, y, 1e30)
    bound = float(norms.median())
    before = snapshot(model)
    got, got_norms = pv.clipped_grad_sum(model, loss_fn, x, y, bound, strategy="hooks", return_norms=True,
                                          **kw)
    assert_state_unchanged(model, before)
    want, _ = loop_clipped_sum(model, loss_fn, x, y, bound)
    torch.testing.assert_close(got_norms, norms, rtol=1e-9, atol=1e-12)
    scale = max(float(w.abs().max()) for w in want.values())
    assert list(got) == list(want)
    for n, w in want.items():
        torch.testing.assert_close(got[n], w, rtol=RTOL, atol=RTOL * scale * 1e-3, msg=lambda m, n=n: f"{n}: {m}")


class TiedLM(nn.Module):
    """Token embedding (padding_idx), a Linear on every token, the output Linear sharing the embedding's weight;
    logits (B, V, T) for CrossEntropyLoss over the T positions."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(self.emb(ids)))).transpose(1, 2)


class TiedLinears(nn.Module):
    """Two Linears on every token share one square weight (their biases apart), then a head on the mean."""

    def __init__(self, dim: int = 5, classes: int = 3):
        super().__init__()
        self.first = nn.Linear(dim, dim)
        self.second = nn.Linear(dim, dim)
        self.second.weight = self.first.weight
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))).mean(1))


class TiedEmbeddings(nn.Module):
    """Two Embeddings share one table (the second with its own padding_idx), a Linear head on the summed means."""

    def __init__(self, vocab: int = 9, dim: int = 4, classes: int = 3):
        super().__init__()
        self.words = nn.Embedding(vocab, dim)
        self.tags = nn.Embedding(vocab, dim, padding_idx=2)
        self.tags.weight = self.words.weight
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.words(ids).mean(1) + self.tags(ids.flip(1)).mean(1)))


def _ids(batch: int, tokens: int, vocab: int, seed: int = 0) -> torch.Tensor:
    ids = torch.randint(0, vocab, (batch, tokens), generator=torch.Generator().manual_seed(seed))
    ids[0, :2] = 0  # padding tokens (Embedding's padding_idx 0 for TiedLM)
    ids[1, 1] = 2
    ids[2, 3] = ids[2, 1]  # a token twice in one sample
    return ids


def _tied_lm():
    torch.manual_seed(0)
    model = TiedLM().double()
    x = _ids(5, 4, 11)
    return model, nn.CrossEntropyLoss(), x, _ids(5, 4, 11, seed=1)


def _never_dense(monkeypatch, *names: str) -> list[str]:
    """Record the layers whose per-sample gradients are built; refuse those named (the tied ones: an untied layer
    may take its per-sample gradients where they are the cheaper, ``GhostRule.instantiates``)."""
    built = []
    real = bookkeeping.dense_grads

    def recording(layer, seen):
        built.append(layer.plan.name)
        assert layer.plan.name not in names, f"per-sample gradients of {layer.plan.name} built"
        return real(layer, seen)

    monkeypatch.setattr(bookkeeping, "dense_grads", recording)
    return built


def test_linear_tied_to_an_embedding_equals_the_loop(monkeypatch):
    _never_dense(monkeypatch, "emb", "out")
    check(*_tied_lm())


def test_two_linears_sharing_a_weight_equal_the_loop(monkeypatch):
    _never_dense(monkeypatch, "first", "second")
    torch.manual_seed(0)
    x = torch.randn(6, 3, 5, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    check(TiedLinears().double(), nn.CrossEntropyLoss(), x, torch.tensor([0, 1, 2, 0, 1, 2]))


def test_two_embeddings_sharing_a_table_equal_the_loop(monkeypatch):
    _never_dense(monkeypatch, "words", "tags")
    torch.manual_seed(0)
    check(TiedEmbeddings().double(), nn.CrossEntropyLoss(), _ids(5, 4, 9), torch.tensor([0, 1, 2, 0, 1]))


def test_tiny_gpt2_with_tied_word_embeddings_equals_the_loop(monkeypatch):
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = t.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40, n_positions=8, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True)
    model = t.GPT2LMHeadModel(config).double().eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    _never_dense(monkeypatch, "transformer.wte", "lm_head")
    ids = torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0  # right padding: no targets there
    x = {"input_ids": ids, "attention_mask": mask}
    check(model, pv.causal_lm_loss, x, ids.masked_fill(mask == 0, -100))


def test_a_dropped_cross_term_fails(monkeypatch):
    """The planted bug: the tied weight's norm without its cross terms (the layers' own norms summed). The values
    differ from the loop's; the per-call check (on by default) refuses it too."""
    monkeypatch.setattr(bookkeeping, "tied_squared_norms", lambda parts: sum(own for *_, own in parts))
    with pytest.raises(AssertionError):
        check(*_tied_lm(), verify=False)
    with pytest.raises(CheckFailedError, match="emb.weight"):
        check(*_tied_lm())


class _Adapted(nn.Module):
    """An RGB stem on 12 x 12 images, its output as 36 tokens, a rank-2 adapter on them (16 -> 2 -> 16), then a Linear
    on 4 pooled tokens: the stem and the adapter's two Linears take their per-sample gradients
    (``GhostRule.instantiates``), the Linear on 4 tokens (16 -> 32) its Grams, the head its ghost norm."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.down, self.up = nn.Linear(16, 2), nn.Linear(2, 16, bias=False)
        self.wide = nn.Linear(16, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x)).flatten(2).mT.reshape(x.shape[0], -1, 16)  # (B, 36, 16) tokens
        h = h + self.up(torch.tanh(self.down(h)))
        pooled = h.reshape(x.shape[0], 4, 9, 16).mean(2)  # (B, 4, 16)
        return self.head(torch.tanh(self.wide(pooled)).mean(1))


def test_layers_whose_per_sample_gradients_are_cheaper_equal_the_loop(monkeypatch):
    built = _never_dense(monkeypatch, "wide", "head")
    x = torch.randn(6, 3, 12, 12, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    torch.manual_seed(0)
    check(_Adapted().double(), nn.CrossEntropyLoss(), x, torch.tensor([0, 1, 2, 0, 1, 2]))
    assert set(built) == {"stem", "down", "up"}


def test_an_hf_conv1d_adapter_takes_its_per_sample_gradients(monkeypatch):
    """Hugging Face's Conv1D (a weight stored (in, out), as GPT-2's) on 24 tokens, 12 -> 2 -> 12: both layers take
    their per-sample gradients (``LinearInOutGhost``), against the loop."""
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    class Adapter(nn.Module):
        def __init__(self):
            super().__init__()
            self.down, self.up, self.head = Conv1D(2, 12), Conv1D(12, 2), nn.Linear(12, 3)

        def forward(self, x):
            return self.head((x + self.up(torch.tanh(self.down(x)))).mean(1))

    built = _never_dense(monkeypatch)
    torch.manual_seed(0)
    x = torch.randn(5, 24, 12, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    check(Adapter().double(), nn.CrossEntropyLoss(), x, torch.tensor([0, 1, 2, 0, 1]))
    assert set(built) == {"down", "up"}


def test_instantiating_is_cheaper_only_where_the_norm_forms_the_gradient_within_the_captures():
    # (tokens, in, out, batch, layer parameters, numbers in the layer's input and output gradient)
    assert instantiating_is_cheaper(197, 192, 192, 16, 192 * 192, 16 * 197 * 384)  # a ViT's on 224 x 224 images
    assert instantiating_is_cheaper(32, 128, 8, 32, 128 * 8, 32 * 32 * 136)  # a LoRA adapter's A
    assert not instantiating_is_cheaper(32, 128, 128, 32, 128 * 128, 32 * 32 * 256)  # BERT's: the Grams faster
    assert not instantiating_is_cheaper(64, 576, 64, 32, 576 * 64, 32 * 64 * 128)  # more numbers than a and g


def test_tied_squared_norms_of_dense_parts_are_the_norm_of_the_sum():
    """Parts given as per-sample gradients (one-hot rows) and as factors add up to the norm of their sum."""
    g = torch.Generator().manual_seed(6)
    left, right = torch.randn(3, 4, 5, generator=g, dtype=torch.float64), torch.randn(3, 4, 2, generator=g,
                                                                                      dtype=torch.float64)
    ids, rows = torch.randint(0, 5, (3, 7), generator=g), torch.randn(3, 7, 2, generator=g, dtype=torch.float64)
    dense = torch.randn(3, 5, 2, generator=g, dtype=torch.float64)
    first = torch.einsum("btr,btc->brc", left, right)
    second = torch.zeros(3, 5, 2, dtype=torch.float64)
    for b in range(3):
        second[b].index_add_(0, ids[b], rows[b])
    # every pair of kinds: indices with factors, indices with indices, factors with indices
    parts = [(ids, rows, second.square().sum((1, 2))), (left, right, first.square().sum((1, 2))),
             dense_part(dense, dense.square().sum((1, 2)))]
    want = (first + second + dense).square().sum((1, 2))
    torch.testing.assert_close(tied_squared_norms(parts), want, rtol=1e-12, atol=1e-12)


class _Switched(nn.Module):
    """Two Linears whose wiring a buffer switches between calls (the same for every sample, so per-sample gradients
    stay defined; no structural key sees a tensor's value): b(a(x)), or a(x) + b(x)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("chained", torch.tensor(True))

    def forward(self, x):
        return self.b(self.a(x)) if bool(self.chained) else self.a(x) + self.b(x)


@pytest.mark.parametrize("first", [True, False])
def test_a_graph_that_changes_between_calls_keeps_every_layer(first):
    """The outputs the backward asks autograd for are remembered from a plan's first call; when a later call's graph
    is wired otherwise (here b's output no longer lies above a's), the call walks its own graph again: the sum still
    equals the loop's, every layer's share in it (asked for a's output alone, b's share would be zero)."""
    torch.manual_seed(0)
    model = _Switched().double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    for chained in (first, not first, first):
        model.chained.fill_(chained)
        want, norms = loop_clipped_sum(model, loss_fn, x, y, 1e30)
        bound = float(norms.median())
        want, _ = loop_clipped_sum(model, loss_fn, x, y, bound)
        got = pv.clipped_grad_sum(model, loss_fn, x, y, bound, strategy="hooks", verify=False)
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=RTOL, atol=1e-12)


class _SwitchedDropout(_Switched):
    """:class:`_Switched` behind a dropout on its input, left on (``randomness='different'``)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        return super().forward(self.drop(x))


def test_a_rewired_call_run_again_draws_the_same_masks():
    """With dropout on, the batch run again after a rewired graph starts from the call's first random state: the
    sum is each sample's under the mask the batch's one forward draws, and the caller's generator ends as after that
    one forward (the per-call check replays the same masks)."""
    torch.manual_seed(0)
    model = _SwitchedDropout().double().train()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    loss_fn = nn.MSELoss(reduction="sum")
    for chained in (True, False, True):
        model.chained.fill_(chained)
        state = torch.get_rng_state()
        got = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, strategy="hooks", randomness="different")
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        mask = model.drop(torch.ones_like(x))  # the batch's draw
        assert torch.equal(after, torch.get_rng_state())
        model.eval()  # each sample alone under its row of that mask
        want, _ = loop_clipped_sum(model, loss_fn, x * mask, y, 0.5)
        model.train()
        for name, w in want.items():
            torch.testing.assert_close(got[name], w, rtol=RTOL, atol=1e-12)
