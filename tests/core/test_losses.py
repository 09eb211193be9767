"""pergrad_viz.core.losses.per_sample_losses equals the loop definition loss_fn(output[i:i+1], targets[i:i+1])."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from helpers import counting_calls
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core import losses, validate
from pergrad_viz.core.losses import per_sample_losses

B = 5
# vmap falls back to a slow path for a few ops (Bilinear, kl_div, sparse): a warning, not a failure
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")
G = torch.Generator().manual_seed(0)


def randn(*shape):
    return torch.randn(*shape, generator=G, dtype=torch.float64)


def rand(*shape):
    return torch.rand(*shape, generator=G, dtype=torch.float64)


def loop(loss_fn, output, targets):
    return torch.stack([loss_fn(output[i:i + 1], targets[i:i + 1]) for i in range(output.shape[0])])


def check(loss_fn, output, targets, fast: bool):
    """Values and gradients (with respect to the output) equal the loop's; the fast path is taken iff ``fast``."""
    assert losses._fast_path_ok(loss_fn, output, targets) is fast
    out1 = output.detach().clone().requires_grad_(True)
    out2 = output.detach().clone().requires_grad_(True)
    got = per_sample_losses(loss_fn, out1, targets)
    want = loop(loss_fn, out2, targets)
    assert got.shape == (output.shape[0],)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14, equal_nan=True)
    weights = torch.linspace(0.5, 2.0, output.shape[0], dtype=torch.float64)
    finite = torch.isfinite(want)
    (g1,) = torch.autograd.grad((got[finite] * weights[finite]).sum(), out1)
    (g2,) = torch.autograd.grad((want[finite] * weights[finite]).sum(), out2)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)


def elementwise_case(cls):
    """(kwargs, output, targets) for each elementwise loss, with extra dimensions (B, 3, 2)."""
    shape = (B, 3, 2)
    if cls is nn.BCELoss:
        return {"weight": rand(3, 2) + 0.5}, torch.sigmoid(randn(*shape)), rand(*shape)
    if cls is nn.BCEWithLogitsLoss:
        return {"pos_weight": rand(2) + 0.5}, randn(*shape), rand(*shape)
    if cls is nn.SoftMarginLoss:
        return {}, randn(*shape), torch.sign(randn(*shape))
    if cls is nn.SmoothL1Loss:
        return {"beta": 0.5}, randn(*shape), randn(*shape)
    if cls is nn.HuberLoss:
        return {"delta": 0.7}, randn(*shape), randn(*shape)
    return {}, randn(*shape), randn(*shape)


def test_the_fast_path_lists_are_what_these_tests_cover():
    assert set(losses._ELEMENTWISE) == {nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss,
                                        nn.BCEWithLogitsLoss, nn.SoftMarginLoss}
    assert set(losses._CLASS_INDEX) == {nn.CrossEntropyLoss, nn.NLLLoss}


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("cls", losses._ELEMENTWISE, ids=lambda c: c.__name__)
def test_elementwise_losses(cls, reduction):
    kw, output, targets = elementwise_case(cls)
    check(cls(reduction=reduction, **kw), output, targets, fast=True)
    check(cls(reduction=reduction), output[:, 0], targets[:, 0], fast=True)  # (B, 2)


def _log_probs_if_nll(cls, logits):
    return F.log_softmax(logits, dim=1) if cls is nn.NLLLoss else logits


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("cls", losses._CLASS_INDEX, ids=lambda c: c.__name__)
def test_class_index_losses(cls, reduction):
    out = _log_probs_if_nll(cls, randn(B, 4))
    y = torch.tensor([0, 3, 1, 1, 2])
    check(cls(reduction=reduction), out, y, fast=True)
    out_k = _log_probs_if_nll(cls, randn(B, 4, 3))  # (B, C, T) with targets (B, T)
    y_k = torch.randint(0, 4, (B, 3), generator=G)
    check(cls(reduction=reduction), out_k, y_k, fast=True)
    # class weights: a weighted mean needs the generic path, a weighted sum does not
    w = torch.tensor([0.5, 2.0, 1.0, 3.0], dtype=torch.float64)
    check(cls(weight=w, reduction=reduction), out_k, y_k, fast=reduction == "sum")


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_cross_entropy_label_smoothing_and_probabilities(reduction):
    out = randn(B, 4, 3)
    y = torch.randint(0, 4, (B, 3), generator=G)
    check(nn.CrossEntropyLoss(label_smoothing=0.15, reduction=reduction), out, y, fast=True)
    probs = torch.softmax(randn(B, 4, 3), dim=1)
    check(nn.CrossEntropyLoss(reduction=reduction), out, probs, fast=True)
    check(nn.CrossEntropyLoss(label_smoothing=0.1, reduction=reduction), out, probs, fast=True)


@pytest.mark.parametrize("cls", losses._CLASS_INDEX, ids=lambda c: c.__name__)
def test_ignore_index_present_goes_the_generic_path(cls):
    out = _log_probs_if_nll(cls, randn(B, 4, 3))
    y = torch.tensor([[0, -100, 1], [3, 3, -100], [1, 2, 0], [-100, -100, 2], [2, 1, 3]])
    check(cls(), out, y, fast=False)  # mean over the non-ignored positions of each sample
    check(cls(reduction="sum"), out, y, fast=True)  # ignored terms are 0 in the sum
    y7 = torch.where(y == -100, torch.tensor(2), y)
    check(cls(ignore_index=2), out, y7, fast=False)
    # a sample whose every target is ignored: 0/0 = nan, as in the loop
    y_all = y.clone()
    y_all[1] = -100
    got = per_sample_losses(cls(), out, y_all)
    assert torch.isnan(got[1]) and torch.isfinite(got[[0, 2, 3, 4]]).all()
    check(cls(), out, y_all, fast=False)
    # ignore_index not present: fast path
    check(cls(), out, y.clamp(min=0), fast=True)


class HalfMSE(nn.MSELoss):
    """Overrides forward with its own reduction: the fast path must not use reduction='none' on it."""

    def forward(self, input, target):
        return 0.5 * ((input - target) ** 2).sum() / input.shape[-1]


class Capped(nn.CrossEntropyLoss):
    def forward(self, input, target):
        return super().forward(input, target).clamp(max=1.0)


def test_subclass_overriding_forward_goes_the_generic_path():
    out, y = randn(B, 3, 2), randn(B, 3, 2)
    check(HalfMSE(reduction="mean"), out, y, fast=False)
    want = torch.stack([0.5 * ((out[i] - y[i]) ** 2).sum() / 2 for i in range(B)])
    torch.testing.assert_close(per_sample_losses(HalfMSE(), out, y), want, rtol=1e-12, atol=1e-14)
    logits = 3 * randn(B, 4)
    check(Capped(), logits, torch.tensor([0, 1, 2, 3, 0]), fast=False)


def test_other_callables_and_reductions():
    out, y = randn(B, 3), randn(B, 3)
    check(lambda o, t: (o - t).abs().pow(3).sum() + o.mean(), out, y, fast=False)
    check(nn.KLDivLoss(reduction="batchmean"), F.log_softmax(out, 1), torch.softmax(y, 1), fast=False)
    # not vmappable (.item()): falls back to a loop on the computed outputs
    check(lambda o, t: F.mse_loss(o, t) * (2.0 if o.sum().item() > 0 else 1.0), out, y, fast=False)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_broadcasting_shapes_go_the_generic_path(reduction):
    """MSELoss on outputs (B, 1) and targets (B,): one batched call would broadcast to (B, B)."""
    check(nn.MSELoss(reduction=reduction), randn(B, 1), randn(B), fast=False)
    check(nn.L1Loss(reduction=reduction), randn(B, 3), randn(B, 1), fast=False)
    check(nn.BCEWithLogitsLoss(reduction=reduction, pos_weight=rand(B, 2)[:1]), randn(B, 2), rand(B, 2),
          fast=False)
    check(nn.CrossEntropyLoss(reduction=reduction), randn(B, 4), torch.tensor([[0], [1], [2], [3], [0]]).view(B),
          fast=True)


def test_a_loss_class_or_reduction_none_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"pass an instance, e\.g\. MSELoss\(\)"):
        validate.check_loss(nn.MSELoss)
    with pytest.raises(ValueError, match=r"reduction='none'.*use reduction='sum'"):
        validate.check_loss(nn.MSELoss(reduction="none"))
    with pytest.raises(ValueError, match=r"shape \(3,\) for one sample instead of a scalar"):
        per_sample_losses(lambda o, t: (o - t).pow(2).sum(0), randn(B, 3), randn(B, 3))


@pytest.mark.parametrize("call", ["grads", "norms", "clipped_sum", "dp_step"])
def test_no_loss_is_refused_before_the_model_runs_naming_the_jacobian(call):
    """loss_fn=None (a Jacobian, inside the package) was taken for a Jacobian's call by the gradients' ones: the
    model ran, then 'NoneType' object is not callable."""
    model = nn.Linear(3, 2)
    ran = []
    model.register_forward_hook(lambda *_: ran.append(1))
    x, y = randn(B, 3), torch.randint(0, 2, (B,))
    calls = {"grads": lambda: pv.per_sample_grads(model, None, x, y),
             "norms": lambda: pv.per_sample_grad_norms(model, None, x, y),
             "clipped_sum": lambda: pv.clipped_grad_sum(model, None, x, y, 1.0),
             "dp_step": lambda: pv.dp_step(model, None, x, y, 1.0, noise_multiplier=0.0, expected_batch_size=B)}
    with pytest.raises(TypeError, match=r"loss_fn must be callable .*got NoneType; .*pv\.per_sample_jacobian\("):
        calls[call]()
    assert not ran


def test_the_users_loss_is_not_modified():
    loss = nn.MSELoss(reduction="sum")
    per_sample_losses(loss, randn(B, 2), randn(B, 2))
    assert loss.reduction == "sum"


# ----------------------------------------------------------------------- causal LM and sequence classification


def token_loop_lm(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,): per sample, the mean over t with labels[i, t + 1] != -100 of -log softmax(logits[i, t])[labels[i, t + 1]],
    written as a plain loop (0 for a sample without any target)."""
    rows = []
    for i in range(logits.shape[0]):
        terms = [-torch.log_softmax(logits[i, t], dim=0)[labels[i, t + 1]]
                 for t in range(logits.shape[1] - 1) if labels[i, t + 1] != -100]
        rows.append(torch.stack(terms).mean() if terms else logits.new_zeros(()) * logits[i].sum())
    return torch.stack(rows)


def lm_case():
    logits = randn(4, 6, 7)
    labels = torch.randint(0, 7, (4, 6), generator=G)
    labels[1, 3:] = -100  # padded: half its targets ignored
    labels[2, 1:] = -100  # no target at all: loss 0
    labels[3, 0] = -100  # position 0 is never a target (nothing predicts it)
    return logits, labels


def test_causal_lm_loss_is_the_per_sample_token_mean():
    logits, labels = lm_case()
    want = token_loop_lm(logits, labels)
    torch.testing.assert_close(losses.causal_lm_loss(logits, labels, reduction="none"), want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(losses.causal_lm_loss(logits, labels), want.mean(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(losses.causal_lm_loss(logits, labels, reduction="sum"), want.sum(), rtol=1e-12,
                               atol=1e-14)
    # the per-sample definition is not the batch's token mean (Hugging Face's model(..., labels=...) loss)
    token_mean = F.cross_entropy(logits[:, :-1].reshape(-1, 7), labels[:, 1:].reshape(-1), ignore_index=-100)
    assert not torch.allclose(token_mean, want.mean())


def test_causal_lm_loss_per_sample_losses_and_gradients_equal_the_token_loop():
    logits, labels = lm_case()
    out1 = logits.clone().requires_grad_(True)
    out2 = logits.clone().requires_grad_(True)
    got = per_sample_losses(losses.causal_lm_loss, out1, labels)
    want = token_loop_lm(out2, labels)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    weights = torch.linspace(0.5, 2.0, 4, dtype=torch.float64)
    (g1,) = torch.autograd.grad((got * weights).sum(), out1)
    (g2,) = torch.autograd.grad((want * weights).sum(), out2)
    torch.testing.assert_close(g1, g2, rtol=1e-12, atol=1e-14)
    assert g1[2].abs().max() == 0  # the sample without targets has no gradient


@pytest.mark.parametrize("make", [lambda: losses.causal_lm_loss,
                                  lambda: functools.partial(losses.causal_lm_loss, reduction="sum"),
                                  lambda: functools.partial(losses.causal_lm_loss, reduction="mean")],
                         ids=["itself", "partial sum", "partial mean"])
def test_the_packages_sequence_losses_take_no_vmap_and_equal_the_token_loop(make, monkeypatch):
    logits, labels = lm_case()
    # counted, not refused: per_sample_losses falls back to a loop on any error
    calls = counting_calls(monkeypatch, torch.func, "vmap")
    torch.testing.assert_close(per_sample_losses(make(), logits, labels), token_loop_lm(logits, labels), rtol=1e-12,
                               atol=1e-14)
    assert not calls, "vmap called for one of the package's own losses"


def test_a_wrapped_sequence_loss_goes_through_vmap_and_agrees():
    logits, labels = lm_case()
    wrapped = lambda o, t: losses.causal_lm_loss(o, t, reduction="sum")  # noqa: E731 - a user's own callable
    with pytest.MonkeyPatch.context() as mp:
        calls = counting_calls(mp, torch.func, "vmap")
        got = per_sample_losses(wrapped, logits, labels)
    assert calls
    torch.testing.assert_close(got, token_loop_lm(logits, labels), rtol=1e-12, atol=1e-14)


def test_losses_take_model_outputs_with_logits():
    from types import SimpleNamespace

    logits, labels = lm_case()
    want = token_loop_lm(logits, labels).mean()
    for output in ({"logits": logits, "loss": None}, SimpleNamespace(logits=logits)):
        torch.testing.assert_close(losses.causal_lm_loss(output, labels), want, rtol=1e-12, atol=1e-14)
    cls_logits, cls_labels = randn(B, 3), torch.randint(0, 3, (B,), generator=G)
    got = losses.sequence_classification_loss({"logits": cls_logits}, cls_labels, reduction="none")
    want = torch.stack([-torch.log_softmax(cls_logits[i], 0)[cls_labels[i]] for i in range(B)])
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(per_sample_losses(losses.sequence_classification_loss, cls_logits, cls_labels), want,
                               rtol=1e-12, atol=1e-14)
    with pytest.raises(TypeError, match="logits"):
        losses.causal_lm_loss({"scores": logits}, labels)


def test_lm_and_classification_losses_refuse_bad_shapes_and_reductions():
    logits, labels = lm_case()
    with pytest.raises(ValueError, match=r"labels \(B, T\)"):
        losses.causal_lm_loss(logits, labels[:, :-1])
    with pytest.raises(ValueError, match=r"logits \(B, C\)"):
        losses.sequence_classification_loss(logits, labels)
    with pytest.raises(ValueError, match="reduction"):
        losses.causal_lm_loss(logits, labels, reduction="batchmean")


def test_lm_and_classification_losses_are_exported():
    import pergrad_viz as pv

    assert pv.causal_lm_loss is losses.causal_lm_loss
    assert pv.sequence_classification_loss is losses.sequence_classification_loss


@pytest.mark.parametrize("strategy", ["auto", *pv.STRATEGIES])
def test_a_loss_without_targets_reads_the_samples_from_the_output(strategy):
    """targets=None: B is the output's first dimension (a loss of the output alone, e.g. an energy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    x = torch.randn(7, 5, dtype=torch.float64)

    def energy(out, targets):
        return out.pow(2).sum() + out[:, 0].exp().sum()

    params = list(model.parameters())
    want = [torch.cat([g.flatten() for g in torch.autograd.grad(energy(model(x[i:i + 1]), None), params)])
            for i in range(len(x))]
    got = pv.per_sample_grads(model, energy, x, None, strategy=strategy, flat=True)
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-10, atol=1e-12)
    norms = torch.stack(want).norm(dim=1)
    clipped = (torch.stack(want) * (0.5 / (norms + 1e-6)).clamp(max=1.0)[:, None]).sum(0)
    summed = pv.clipped_grad_sum(model, energy, x, None, 0.5, strategy=strategy)
    torch.testing.assert_close(torch.cat([t.flatten() for t in summed.values()]), clipped, rtol=1e-10, atol=1e-12)


def test_a_loss_without_targets_of_an_output_without_samples_is_refused():
    with pytest.raises(ValueError, match="targets=None, and the model's output holds no tensor"):
        per_sample_losses(lambda out, t: out, torch.tensor(1.0, requires_grad=True), None)


class _ReturnsItsLoss(nn.Module):
    """A model that computes its own batch-mean loss from (x, y), as Hugging Face models do with labels=."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 3)

    def forward(self, x, y):
        out = self.inner(x)
        return {"logits": out, "loss": nn.functional.cross_entropy(out, y)}


@pytest.mark.parametrize("strategy", ["auto", "torch_func", "loop"])
def test_a_model_returning_its_own_loss_with_targets_none(strategy):
    """Found by a probe: the check's forward-mode pass vmapped over targets=None (a raw vmap ValueError)."""
    torch.manual_seed(0)
    model, x, y = _ReturnsItsLoss().double(), torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 3, (6,))
    got = pv.per_sample_grads(model, lambda out, t: out["loss"], (x, y), None, strategy=strategy)
    for i in range(6):
        want = torch.autograd.grad(model(x[i:i + 1], y[i:i + 1])["loss"], list(model.parameters()))
        for (name, _), w in zip(model.named_parameters(), want, strict=True):
            torch.testing.assert_close(got[name][i], w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("returned", ["pair with metrics", "pair of tensors", "list", "dict", "item", "none",
                                      "complex"])
@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func", "loop"])
def test_a_loss_that_returns_no_tensor_is_refused_naming_the_fix(returned, strategy):
    """Found by a probe: a (loss, metrics) pair gave raw 'Could not infer dtype of dict' or ''tuple' object has no
    attribute 'shape'' errors under auto and hooks; loss.item() was refused as 'no parameter takes part'."""
    model, x, y = nn.Linear(4, 3), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])

    def loss_fn(out, t):
        loss = F.cross_entropy(out, t)
        return {"pair with metrics": lambda: (loss, {"acc": 1.0}), "pair of tensors": lambda: (loss, out.sum()),
                "list": lambda: [loss], "dict": lambda: {"loss": loss}, "item": lambda: loss.item(),
                "none": lambda: None, "complex": lambda: loss * (1 + 1j)}[returned]()

    fix = {"item": r"got float.*not loss\.item\(\)", "none": "got NoneType",
           "complex": r"complex loss.*loss\.real"}.get(returned, r"got \w+: return the loss alone")
    with pytest.raises(TypeError, match=fix):
        pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy)


def test_sequence_classification_loss_keeps_the_labels_precision_and_names_float_class_labels():
    """Found by a review: a bfloat16 regression head's float32 labels were rounded to bfloat16 (1003 -> 1004; rows up
    to 66% off); float labels (B,) for several classes were PyTorch's raw dtype error."""
    logits = torch.tensor([[1000.0], [200.0]], dtype=torch.bfloat16)
    labels = torch.tensor([1003.0, 201.7])
    want = (logits.float().reshape(-1) - labels).square()
    torch.testing.assert_close(pv.sequence_classification_loss(logits, labels, reduction="none"), want)
    integers = pv.sequence_classification_loss(torch.tensor([[256.0]], dtype=torch.bfloat16), torch.tensor([257]),
                                               reduction="none")
    assert float(integers) == 1.0  # integer labels of a bfloat16 head were rounded too (257 -> 256: loss 0)
    with pytest.raises(ValueError, match=r"class indices \(B,\) \(integers: labels.long\(\)\)"):
        pv.sequence_classification_loss(torch.randn(2, 3), torch.tensor([0.0, 2.0]))
