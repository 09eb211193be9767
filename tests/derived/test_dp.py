"""pv.clipped_grad_sum and pv.dp_step: equal to the definition written plainly here (a loop of per-sample
autograd.grad, each sample clipped to C, summed), in float64, on the zoo, the tutorial's networks and tiny Hugging
Face models (masks, padding, -100 labels, LoRA), with per-layer clipping; the model left as it was."""

from __future__ import annotations

import functools
import math
import os
import warnings

import pytest
import torch
from helpers import TwoDtypes, assert_state_unchanged, snapshot
from torch import nn
from zoo.cases import CASES
from zoo.nets import CASES as NET_CASES
from zoo.nets import DoublyTiedNet, build_net

import pergrad_viz as pv
from pergrad_viz import api
from pergrad_viz.derived import bookkeeping
from pergrad_viz.derived import sums as sums_mod
from pergrad_viz.tutorial import hf_models
from pergrad_viz.tutorial.networks import MLP, LSTMClassifier, SmallCNN, TransformerClassifier

os.environ["HF_HUB_OFFLINE"] = "1"
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]
RTOL = 1e-6


def _cut(obj, i: int, batch: int):
    if isinstance(obj, torch.Tensor):
        return obj[i:i + 1] if obj.dim() >= 1 and obj.shape[0] == batch else obj
    if isinstance(obj, dict):
        return {k: _cut(v, i, batch) for k, v in obj.items()}
    return obj


def loop_clipped_sum(model, loss_fn, x, y, bounds, names=None):
    """The definition: per sample, autograd.grad of its loss alone; each group of parameters (``bounds``: a list of
    (C_k, names)) scaled by min(1, C_k / (norm + 1e-6)); summed over samples. Also the (B,) total norms."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    batch = (y if isinstance(y, torch.Tensor) else next(iter(x.values()))).shape[0]
    total = {n: torch.zeros_like(p) for n, p in named}
    norms = []
    for i in range(batch):
        xi = _cut(x, i, batch)
        out = model(**xi) if isinstance(xi, dict) else model(xi)
        grads = torch.autograd.grad(loss_fn(out, _cut(y, i, batch)), [p for _, p in named], allow_unused=True)
        g = {n: torch.zeros_like(p) if gi is None else gi for gi, (n, p) in zip(grads, named, strict=True)}
        norms.append(math.sqrt(sum(float(t.square().sum()) for t in g.values())))
        for bound, members in bounds:
            norm = math.sqrt(sum(float(g[n].square().sum()) for n in members))
            for n in members:
                total[n] += min(1.0, bound / (norm + 1e-6)) * g[n]
    return total, torch.tensor(norms, dtype=torch.float64)


def assert_sums_close(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    scale = max(float(w.abs().max()) for w in want.values())
    for n, w in want.items():
        assert got[n].shape == w.shape and got[n].dtype == w.dtype, n
        torch.testing.assert_close(got[n], w, rtol=RTOL, atol=RTOL * scale * 1e-3, msg=lambda m, n=n: f"{n}: {m}")


def names_of(model):
    return tuple(n for n, p in model.named_parameters() if p.requires_grad)


def check(model, loss_fn, x, y, max_norm=None, per_layer=False, bounds=None, **kw):
    """clipped_grad_sum against the loop, the model left as it was (and .grad alone); returns the norms."""
    names = names_of(model)
    if bounds is None:
        bounds = [(max_norm, names)]
    before = snapshot(model)
    got, norms = pv.clipped_grad_sum(model, loss_fn, x, y, max_norm, per_layer=per_layer, return_norms=True, **kw)
    assert_state_unchanged(model, before)
    want, want_norms = loop_clipped_sum(model, loss_fn, x, y, bounds)
    assert_sums_close(got, want)
    torch.testing.assert_close(norms, want_norms, rtol=1e-9, atol=1e-12)
    return want_norms


def median_bound(model, loss_fn, x, y) -> float:
    """A bound that clips about half of the samples (so that both branches of min(1, .) are taken)."""
    _, norms = loop_clipped_sum(model, loss_fn, x, y, [(1e30, names_of(model))])
    return float(norms.median())


# The zoo: every case a strategy computes (hooks or each sample alone), with a bound between the samples' norms ----

ZOO = [c for c in CASES if c.expects(0) != "refuse"]


@pytest.mark.parametrize("case", ZOO, ids=lambda c: c.name)
def test_zoo_equals_the_loop(case):
    model = case.prepare(case.make_model(), 0)
    x, y = case.make_inputs(case.batches[0])
    loss_fn = next(iter(case.loss_fns.values()))()
    # hooks where it runs: a wrong rule is then an error here, not a silent hand-over to torch_func
    strategy = "hooks" if case.expects(0) == "hooks" else "auto"
    check(model, loss_fn, x, y, median_bound(model, loss_fn, x, y), strategy=strategy)


# The tutorial's networks and the bench's kinds, float64 -----------------------------------------------------------


def _tutorial(name: str):
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(12, 9, 4).double(), torch.randn(6, 12, generator=g, dtype=torch.float64)
    if name == "cnn":
        return SmallCNN(n_classes=4).double(), torch.randn(4, 1, 28, 28, generator=g, dtype=torch.float64)
    if name == "transformer":
        model = TransformerClassifier(d_model=16, heads=2, feedforward=24, classes=4).double().eval()
        return model, torch.randn(5, 6, 16, generator=g, dtype=torch.float64)
    return LSTMClassifier(features=6, hidden=8, classes=4).double(), torch.randn(5, 7, 6, generator=g,
                                                                                 dtype=torch.float64)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "lstm"])
def test_tutorial_networks_equal_the_loop(name):
    model, x = _tutorial(name)
    y = torch.randint(0, 4, (x.shape[0],), generator=torch.Generator().manual_seed(2))
    loss_fn = nn.CrossEntropyLoss()
    check(model, loss_fn, x, y, median_bound(model, loss_fn, x, y), strategy="hooks")


def test_hooked_path_never_materialises(monkeypatch):
    """On a model the hooks strategy runs, the clipped sum comes from the captures: per_sample_grads is not called."""
    model, x = _tutorial("transformer")
    y = torch.tensor([0, 1, 2, 3, 0])

    def refuse(*args, **kwargs):
        raise AssertionError("per_sample_grads was called")

    monkeypatch.setattr(api, "per_sample_grads", refuse)
    check(model, nn.CrossEntropyLoss(), x, y, 0.05)


def test_a_planted_wrong_clip_factor_fails(monkeypatch):
    model, x = _tutorial("mlp")
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    loss_fn = nn.CrossEntropyLoss()
    bound = median_bound(model, loss_fn, x, y)
    right = bookkeeping.clip_factors

    def wrong(squared, groups, dtype, *total):
        factors = right(squared, groups, dtype, *total)
        return {n: c * (1 + 1e-5) for n, c in factors.items()}

    monkeypatch.setattr(bookkeeping, "clip_factors", wrong)
    with pytest.raises(AssertionError):
        check(model, loss_fn, x, y, bound)


# Hugging Face models: -100 labels, attention masks with padding, LoRA ----------------------------------------------

TOKENS = 8


def _ids(batch: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, TOKENS), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("name", ["gpt2", "lora_llama"])
def test_causal_lms_with_ignored_labels(name):
    pytest.importorskip("transformers")
    if name == "lora_llama":
        pytest.importorskip("peft")
    torch.manual_seed(0)
    model = getattr(hf_models, name)().double().eval()
    x = _ids(3, hf_models.VOCAB)
    y = x.clone()
    y[1, 5:] = -100  # fewer targets in sample 1: its own token mean
    check(model, pv.causal_lm_loss, x, y, median_bound(model, pv.causal_lm_loss, x, y), strategy="hooks")


def _masked_batch(batch: int, vocab: int):
    ids = _ids(batch, vocab)
    mask = torch.ones_like(ids)
    mask[0, 5:] = 0  # right padding in sample 0
    mask[2, 3:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


def test_bert_with_attention_mask_and_padding():
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = t.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                          vocab_size=50, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    model = t.BertForSequenceClassification(config).double().eval()
    x = _masked_batch(4, 50)
    y = torch.tensor([0, 1, 2, 1])
    loss_fn = pv.sequence_classification_loss
    check(model, loss_fn, x, y, median_bound(model, loss_fn, x, y), strategy="hooks")


def test_gpt2_with_attention_mask_padding_and_ignored_labels():
    t = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = t.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=16, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    model = t.GPT2LMHeadModel(config).double().eval()
    x = _masked_batch(3, 50)
    y = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)
    check(model, pv.causal_lm_loss, x, y, median_bound(model, pv.causal_lm_loss, x, y), strategy="hooks")


# Per-layer clipping ------------------------------------------------------------------------------------------------


def test_per_layer_true_clips_each_parameter_to_its_share():
    model, x = _tutorial("cnn")
    y = torch.tensor([0, 1, 2, 3])
    names = names_of(model)
    bound = 0.3
    check(model, nn.CrossEntropyLoss(), x, y, bound, per_layer=True,
          bounds=[(bound / math.sqrt(len(names)), (n,)) for n in names])


def test_per_layer_dict_groups_by_longest_prefix():
    model, x = _tutorial("transformer")
    y = torch.tensor([0, 1, 2, 3, 0])
    names = names_of(model)
    head = tuple(n for n in names if n.startswith("head."))
    layer0 = tuple(n for n in names if n.startswith("encoder.layers.0."))
    rest = tuple(n for n in names if n not in head + layer0)
    groups = {"": 0.02, "head": 0.05, "encoder.layers.0": 0.01}
    check(model, nn.CrossEntropyLoss(), x, y, None, per_layer=groups,
          bounds=[(0.02, rest), (0.05, head), (0.01, layer0)])


# Noise, the materialised route, dp_step ---------------------------------------------------------------------------


def test_noise_comes_from_the_generator_alone():
    model, x = _tutorial("mlp")
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    loss_fn = nn.CrossEntropyLoss()
    plain = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5)
    state = torch.get_rng_state()
    noisy = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, noise_multiplier=1.3,
                                generator=torch.Generator().manual_seed(5))
    assert torch.equal(torch.get_rng_state(), state)
    g = torch.Generator().manual_seed(5)
    for n, p in model.named_parameters():  # in order, each parameter's noise drawn at once
        want = plain[n] + torch.empty(p.shape, dtype=p.dtype).normal_(0.0, 1.3 * 0.5, generator=g)
        torch.testing.assert_close(noisy[n], want, rtol=1e-12, atol=1e-12)


def test_noise_has_the_stated_spread_and_a_hand_over_draws_it_again():
    sums = sums_mod.initial_sums([("a", (40, 30), torch.float64, "cpu"), ("b", (5,), torch.float64, "cpu")], 2.0,
                           torch.Generator().manual_seed(0))
    values = torch.cat([sums["a"].reshape(-1), sums["b"]])
    assert values.unique().numel() == values.numel() and 1.9 < float(values.std()) < 2.1
    model, x = _tutorial("mlp")
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    loss_fn = nn.CrossEntropyLoss()
    hooks = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, noise_multiplier=1.0,
                                generator=torch.Generator().manual_seed(3))
    func = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, noise_multiplier=1.0,
                               generator=torch.Generator().manual_seed(3), strategy="torch_func")
    for n in hooks:
        torch.testing.assert_close(hooks[n], func[n], rtol=1e-12, atol=1e-12)


def test_sums_made_in_any_order_draw_the_noise_in_parameter_order():
    """The layers ask for their sums bottom layer first (after the backward let the others' activations go): each
    tensor is made when first asked for, every earlier parameter's first, so the draws do not depend on that order."""
    shapes = [(n, shape, torch.float64, "cpu") for n, shape in (("a", (3, 2)), ("b", (4,)), ("c", (2, 2)))]
    want = sums_mod.initial_sums(shapes, 1.5, torch.Generator().manual_seed(7))
    lazy = sums_mod.LazySums(shapes, 1.5, torch.Generator().manual_seed(7))
    assert torch.equal(lazy["b"], want["b"]) and list(lazy) == ["a", "b"]  # "a" made first, "c" not yet
    got = lazy.complete()
    assert list(got) == ["a", "b", "c"] and type(got) is dict
    for n in want:
        assert torch.equal(got[n], want[n])
    zeros = sums_mod.LazySums(shapes, 0.0, None)  # no draws: each made alone; handed out unwritten once, to a writer
    assert not zeros["c"].any() and list(zeros) == ["c"]
    b, unwritten = zeros.destination("b")
    assert unwritten and zeros.destination("b") == (b, False) and zeros.destination("c")[1] is False
    assert list(zeros.complete()) == ["a", "b", "c"] and not zeros.complete()["a"].any()
    noisy = sums_mod.LazySums(shapes, 1.0, torch.Generator().manual_seed(0))
    assert noisy.destination("a")[1] is False  # noise in it: always added to


@pytest.mark.parametrize("strategy", ["torch_func", "loop"])
def test_materialised_route_equals_the_loop(strategy):
    model, x = _tutorial("cnn")
    y = torch.tensor([0, 1, 2, 3])
    check(model, nn.CrossEntropyLoss(), x, y, 0.2, strategy=strategy, chunk_size=3)


def test_chunks_give_the_same_sum():
    model, x = _tutorial("lstm")
    y = torch.tensor([0, 1, 2, 3, 0])
    check(model, nn.CrossEntropyLoss(), x, y, 0.1, chunk_size=2)


def test_dp_step_writes_the_mean_into_grad_and_steps_like_pytorch():
    model, x = _tutorial("mlp")
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    loss_fn = nn.CrossEntropyLoss()
    want, _ = loop_clipped_sum(model, loss_fn, x, y, [(0.4, names_of(model))])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.zero_grad()
    pv.dp_step(model, loss_fn, x, y, 0.4, noise_multiplier=0.0, generator=None, expected_batch_size=8)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n] / 8, rtol=RTOL, atol=1e-12)
    opt.step()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), before[n] - 0.1 * want[n] / 8, rtol=RTOL, atol=1e-12)
    pv.dp_step(model, loss_fn, x, y, 0.4, noise_multiplier=0.0, generator=None)  # this batch's B
    want, _ = loop_clipped_sum(model, loss_fn, x, y, [(0.4, names_of(model))])
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n] / 6, rtol=RTOL, atol=1e-12)


# Bad input: a clear error before any work --------------------------------------------------------------------------


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_norm": 0.0}, "max_norm must be a finite number > 0"),
    ({"max_norm": float("inf")}, "max_norm must be a finite number > 0"),
    ({"max_norm": True}, "max_norm must be a finite number > 0"),
    ({"max_norm": None}, "max_norm must be a finite number > 0"),
    ({"noise_multiplier": -1.0}, "noise_multiplier must be a finite number >= 0"),
    ({"noise_multiplier": 1.0}, "needs generator="),
    ({"per_layer": {"": 1.0}}, "pass max_norm=None"),
    ({"max_norm": None, "per_layer": {"fc": 1.0}}, "is in no group"),
    ({"max_norm": None, "per_layer": {"": -1.0}}, r"per_layer\[''\] must be a finite number > 0"),
    ({"max_norm": None, "per_layer": {"": 1.0, "fc9": 2.0}}, "match no trainable parameter"),
    ({"max_norm": torch.ones(2)}, "max_norm must be a finite number > 0"),
    ({"per_layer": "yes"}, "per_layer must be"),
])
def test_bad_arguments_are_refused_before_any_work(kwargs, match, monkeypatch):
    model, x = _tutorial("mlp")
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    args = {"max_norm": 1.0, **kwargs}
    max_norm = args.pop("max_norm")
    if "is in no group" not in match and "no trainable" not in match:  # refused before the batch is looked at
        monkeypatch.setattr(api, "prepare", lambda *a, **k: pytest.fail("work started"))
    before = snapshot(model)
    with pytest.raises((ValueError, TypeError), match=match):
        pv.clipped_grad_sum(model, nn.CrossEntropyLoss(), x, y, max_norm, **args)
    assert_state_unchanged(model, before)


def test_numbers_from_numpy_and_0_dim_tensors_are_numbers():
    np = pytest.importorskip("numpy")
    model, x = _tutorial("mlp")
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    loss_fn = nn.CrossEntropyLoss()
    want = pv.clipped_grad_sum(model, loss_fn, x, y, 0.5, noise_multiplier=1.0,
                               generator=torch.Generator().manual_seed(3))
    for bound, sigma in ((np.float32(0.5), np.float32(1.0)), (torch.tensor(0.5), torch.tensor(1.0))):
        got = pv.clipped_grad_sum(model, loss_fn, x, y, bound, noise_multiplier=sigma,
                                  generator=torch.Generator().manual_seed(3))
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7)
    by_dict = pv.clipped_grad_sum(model, loss_fn, x, y, None, per_layer={"": np.float32(0.5)})
    plain = pv.clipped_grad_sum(model, loss_fn, x, y, None, per_layer={"": 0.5})
    for n in plain:
        torch.testing.assert_close(by_dict[n], plain[n])


def test_generator_type_and_expected_batch_size_are_checked():
    model, x = _tutorial("mlp")
    y = torch.tensor([0, 1, 2, 3, 0, 1])
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        pv.clipped_grad_sum(model, nn.CrossEntropyLoss(), x, y, 1.0, noise_multiplier=1.0, generator=5)
    state = torch.get_rng_state()  # the global generator passed as the noise's (a probe): refused, nothing drawn
    with pytest.raises(ValueError, match="torch's global generator"):
        pv.dp_step(model, nn.CrossEntropyLoss(), x, y, 1.0, noise_multiplier=1.0, generator=torch.default_generator,
                   expected_batch_size=6)
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(ValueError, match="expected_batch_size must be a positive int"):
        pv.dp_step(model, nn.CrossEntropyLoss(), x, y, 1.0, noise_multiplier=0.0, generator=None,
                   expected_batch_size=0)
    assert all(p.grad is None for p in model.parameters())


def test_attention_and_linears_take_book_keeping(monkeypatch):
    """In the transformer only the LayerNorms give their per-sample gradients (B, D); MultiheadAttention's
    projections and the Linears take their ghost norms and weighted sums."""
    model, x = _tutorial("transformer")
    y = torch.tensor([0, 1, 2, 3, 0])
    dense_types = []
    real = bookkeeping.dense_grads

    def recording(layer, seen):
        dense_types.append(type(layer.module).__name__)
        return real(layer, seen)

    monkeypatch.setattr(bookkeeping, "dense_grads", recording)
    check(model, nn.CrossEntropyLoss(), x, y, 0.05, strategy="hooks")
    assert dense_types and set(dense_types) == {"LayerNorm"}


# The agreement grid's networks: every convolution configuration (padding modes, 'same', groups, strides), tied and
# shared layers, frozen and unused parameters, in-place ReLU, layers on the per-layer fallback ---------------------


@pytest.mark.parametrize("name", NET_CASES)
def test_agreement_grid_networks_equal_the_loop(name):
    model, x, y, loss_fn, _ = build_net(name)
    model = model.double()
    x = x.double() if x.is_floating_point() else x
    y = y.double() if y.is_floating_point() else y
    strategy = "hooks" if pv.resolve_strategy("auto", model, x) == "hooks" else "auto"
    check(model, loss_fn, x, y, median_bound(model, loss_fn, x, y), strategy=strategy)


def test_doubly_tied_and_shared_layers():
    model = DoublyTiedNet().double()
    x = torch.tensor([[1, 2, 1], [3, 3, 0], [5, 4, 2], [0, 1, 5]])
    y = torch.tensor([0, 3, 5, 1])
    check(model, nn.CrossEntropyLoss(), x, y, median_bound(model, nn.CrossEntropyLoss(), x, y), strategy="hooks")


@pytest.mark.parametrize("strategy, chunk_size", [("hooks", None), ("hooks", 2), ("torch_func", None),
                                                  ("loop", None), ("auto", None)])
def test_a_sample_with_a_non_finite_gradient_is_named_not_summed(strategy, chunk_size):
    """One sample with an inf input makes its gradient inf / NaN, and 0 * inf would make every entry of the sum NaN
    (the loop's sum of the definition is NaN too): refused, naming the batch row, before .grad is touched."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 2, (5,))
    x[3, 1] = math.inf
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"sample\(s\) \[3\] of this batch have a gradient that is not finite"):
        pv.clipped_grad_sum(model, nn.CrossEntropyLoss(), x, y, 1.0, strategy=strategy, chunk_size=chunk_size)
    with pytest.raises(ValueError, match=r"sample\(s\) \[3\]"):
        pv.dp_step(model, nn.CrossEntropyLoss(), x, y, 1.0, noise_multiplier=0.0, generator=None, strategy=strategy)
    assert_state_unchanged(model, before)
    x[3, 1] = 0.0  # the same batch made finite: the definition
    want, _ = loop_clipped_sum(model, nn.CrossEntropyLoss(), x, y, [(1.0, [n for n, _ in model.named_parameters()])])
    assert_sums_close(pv.clipped_grad_sum(model, nn.CrossEntropyLoss(), x, y, 1.0, strategy=strategy,
                                          chunk_size=chunk_size), want)


def test_a_nan_target_is_named_too():
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    y[0, 1] = math.nan
    with pytest.raises(ValueError, match=r"sample\(s\) \[0\]"):
        pv.clipped_grad_sum(model, nn.MSELoss(reduction="sum"), x, y, 1.0)


def test_a_model_of_two_dtypes_gets_its_sums_in_each_parameters_dtype():
    """Found by a probe: the sums were added in the parameters' dtypes from per-sample gradients in another, a raw
    dtype error from addmm_."""
    model = TwoDtypes()
    x, y = torch.randn(6, 6, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1, 2])
    loss = nn.CrossEntropyLoss(reduction="sum")
    rows = []
    for i in range(6):
        rows.append(torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters())))
    norms = torch.stack([sum(g.double().square().sum() for g in r) for r in rows]).sqrt()
    factors = (0.3 / (norms + 1e-6)).clamp(max=1.0)
    got = pv.clipped_grad_sum(model, loss, x, y, 0.3)
    for k, (name, p) in enumerate(model.named_parameters()):
        want = sum(factors[i] * rows[i][k].double() for i in range(6))
        assert got[name].dtype == p.dtype
        torch.testing.assert_close(got[name].double(), want, rtol=1e-5, atol=1e-6, msg=name)


def test_dp_step_writes_into_the_grad_tensors_a_flat_buffer_holds():
    """Found by a probe: dp_step replaced .grad by new tensors, so a flat gradient buffer whose views the parameters
    held (flat-buffer optimisers, DDP's gradient_as_bucket_view) never saw the step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 3, (8,))
    params = list(model.parameters())
    arena = torch.full((sum(p.numel() for p in params),), 7.0, dtype=torch.float64)  # stale values: replaced
    views = list(arena.split([p.numel() for p in params]))
    for p, v in zip(params, views, strict=True):
        p.grad = v.view_as(p)
    held = [p.grad for p in params]
    want = pv.clipped_grad_sum(model, nn.CrossEntropyLoss(reduction="sum"), x, y, 0.3)
    pv.dp_step(model, nn.CrossEntropyLoss(reduction="sum"), x, y, 0.3, noise_multiplier=0.0, expected_batch_size=8)
    assert all(p.grad is h for p, h in zip(params, held, strict=True))
    torch.testing.assert_close(arena, torch.cat([want[n].flatten() for n, _ in model.named_parameters()]) / 8)


def test_dp_step_lays_grad_out_as_the_parameter_and_replaces_a_sparse_one():
    """Found by a probe: dp_step wrote a channels_last conv weight's .grad contiguous, and AdamW(fused=True), which
    reads .grad in the parameter's layout as a backward gives it, updated the wrong elements (0.2 off); a sparse
    Embedding's .grad kept by zero_grad(set_to_none=False) was a raw copy_ error, other .grad already written."""
    torch.manual_seed(0)
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)).double()
    conv = conv.to(memory_format=torch.channels_last)
    x, y = torch.randn(5, 3, 6, 6, dtype=torch.float64), torch.randint(0, 3, (5,))
    loss_fn = nn.CrossEntropyLoss()
    want, _ = loop_clipped_sum(conv, loss_fn, x, y, [(0.3, names_of(conv))])
    twin = {n: p.detach().clone().requires_grad_() for n, p in conv.named_parameters()}
    for t, g in zip(twin.values(), want.values(), strict=True):
        t.grad = g / 5
    opt = torch.optim.AdamW(conv.parameters(), lr=0.1, fused=True)
    pv.dp_step(conv, loss_fn, x, y, 0.3, noise_multiplier=0.0, expected_batch_size=5)
    assert conv[0].weight.grad.stride() == conv[0].weight.stride() and not conv[0].weight.is_contiguous()
    opt.step()
    torch.optim.AdamW(list(twin.values()), lr=0.1, foreach=False).step()
    for n, p in conv.named_parameters():
        torch.testing.assert_close(p.detach(), twin[n].detach(), rtol=1e-9, atol=1e-12, msg=n)

    bag = nn.Sequential(nn.Embedding(12, 6, sparse=True), nn.Flatten(), nn.Linear(30, 3)).double()
    ids = torch.randint(0, 12, (4, 5))
    loss_fn(bag(ids), y[:4]).backward()
    torch.optim.SGD(bag.parameters(), lr=0.1).zero_grad(set_to_none=False)
    assert bag[0].weight.grad.is_sparse
    want, _ = loop_clipped_sum(bag, loss_fn, ids, y[:4], [(0.3, names_of(bag))])
    pv.dp_step(bag, loss_fn, ids, y[:4], 0.3, noise_multiplier=0.0, expected_batch_size=4)
    for n, p in bag.named_parameters():
        assert p.grad.layout == torch.strided
        torch.testing.assert_close(p.grad, want[n] / 4, rtol=1e-9, atol=1e-12, msg=n)


def test_a_bound_whose_square_overflows_gives_the_plain_sum_and_finite_noise():
    """Found by a probe: sqrt(sum C_k^2) overflowed for a bound of 1e155, so the std was sigma x inf: a raw 'std -nan'
    error without noise, sums of +-inf with it (a true std of 1e-45)."""
    model, x = _tutorial("mlp")
    y, loss_fn = torch.tensor([0, 1, 2, 3, 0, 1]), nn.CrossEntropyLoss()
    want, _ = loop_clipped_sum(model, loss_fn, x, y, [(1e155, names_of(model))])
    for sigma in (0.0, 1e-200):
        got = pv.clipped_grad_sum(model, loss_fn, x, y, 1e155, noise_multiplier=sigma,
                                  generator=torch.Generator().manual_seed(0))
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=RTOL, atol=1e-12)
    with pytest.raises(ValueError, match="noise's std .* is inf"):
        pv.clipped_grad_sum(model, loss_fn, x, y, None, per_layer={"": 1e300}, noise_multiplier=1e100,
                            generator=torch.Generator().manual_seed(0))


def test_a_fresh_generator_seeded_alike_at_every_step_is_warned_of():
    """Found by a newcomer's probe: torch.Generator().manual_seed(0) made anew at every step repeated the noise,
    silently; one generator passed at every step says nothing."""
    x, y = torch.randn(4, 3), torch.tensor([0, 1, 0, 1])
    model = nn.Linear(3, 2)
    step = functools.partial(pv.dp_step, model, nn.CrossEntropyLoss(), x, y, 1.0, noise_multiplier=1.0,
                             expected_batch_size=4)
    step(generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="noise repeats") as caught:
        step(generator=torch.Generator().manual_seed(0))
    assert caught[0].filename == __file__  # pointed at the caller's line
    with pytest.warns(UserWarning, match="noise repeats"):
        pv.noise_step(model, 1.0, noise_multiplier=1.0, generator=torch.Generator().manual_seed(0),
                      expected_batch_size=4)
    once = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(3):
            step(generator=once)
        pv.clipped_grad_sum(model, nn.CrossEntropyLoss(), x, y, 1.0, generator=torch.Generator().manual_seed(0))
    # a step refused before it draws (a probe: the warning came first, for noise never drawn) says only its error
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="batch sizes differ"):
            step.func(model, nn.CrossEntropyLoss(), x, y[:3], 1.0, noise_multiplier=1.0, expected_batch_size=4,
                      generator=torch.Generator().manual_seed(0))


def test_class_weights_that_divide_out_of_each_sample_are_warned_of():
    """Found by a probe: CrossEntropyLoss(weight=w) with reduction='mean' gave exactly the unweighted clipped sum
    (each sample's loss is its own weighted mean, w_y l / w_y), silently; 'sum' keeps the weights and says nothing."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(3, 3), torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])
    weight = torch.tensor([1.0, 5.0, 0.2])
    with pytest.warns(UserWarning, match="weights divide out") as caught:
        weighted = pv.clipped_grad_sum(model, nn.CrossEntropyLoss(weight=weight), x, y, 0.5)
    assert caught[0].filename == __file__
    plain = pv.clipped_grad_sum(model, nn.CrossEntropyLoss(), x, y, 0.5)
    for name in plain:
        torch.testing.assert_close(weighted[name], plain[name])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pv.clipped_grad_sum(model, nn.CrossEntropyLoss(weight=weight, reduction="sum"), x, y, 0.5)
        pv.dp_step(model, nn.CrossEntropyLoss(), x, y, 0.5, noise_multiplier=0.0, expected_batch_size=6)
    with pytest.warns(UserWarning, match="weights divide out"):
        pv.dp_step(model, nn.NLLLoss(weight=weight), x, y, 0.5, noise_multiplier=0.0, expected_batch_size=6)
