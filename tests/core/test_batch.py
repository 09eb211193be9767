"""Inputs as models take them (pergrad_viz.core.batch): a tensor, a tuple, a dict or BatchEncoding, model_kwargs, shared
tensors passed unchanged; outputs that are tuples, dicts, dataclasses or Hugging Face ModelOutputs. Every strategy,
Jacobians (output=), norms and the NTK against a plain loop written here: model(x[i:i+1], mask[i:i+1])."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers import assert_no_hooks, assert_state_unchanged, snapshot
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core.batch import Batch, cut

DT = torch.float64
B, T = 5, 6


class MaskedEncoder(nn.Module):
    """Embedding, a shared (T, T) additive bias, a per-sample padding mask, mean over the unmasked tokens."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(11, 8)
        self.fc = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, ids, attention_mask=None, bias=None, flag: bool = True):
        h = torch.tanh(self.fc(self.emb(ids)))  # (B, T, 8)
        if bias is not None:  # shared (T, T): mixes tokens, never samples
            h = h + torch.einsum("ts,bsd->btd", bias, h) * 0.1
        m = attention_mask.to(h.dtype).unsqueeze(-1)
        pooled = (h * m).sum(1) / m.sum(1)
        return self.head(pooled * self.scale if flag else pooled)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    hidden: torch.Tensor


class DictOutput(MaskedEncoder):
    def forward(self, ids, attention_mask=None, bias=None, flag: bool = True):
        logits = super().forward(ids, attention_mask, bias, flag)
        return {"logits": logits, "hidden": logits.tanh()}


class DataclassOutput(MaskedEncoder):
    def forward(self, ids, attention_mask=None, bias=None, flag: bool = True):
        logits = super().forward(ids, attention_mask, bias, flag)
        return Out(logits, logits.tanh())


def _data():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 11, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, T // 2:] = 0  # a padded sample whose mask hides half its tokens
    mask[3, 4:] = 0
    ids[mask == 0] = 0
    bias = torch.randn(T, T, generator=g, dtype=DT)
    return ids, mask, bias, torch.randint(0, 3, (B,), generator=g)


def _loop_grads(model, loss_fn, call_one):
    """The definition, written here: one forward and backward per sample."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = []
    for i in range(B):
        grads = torch.autograd.grad(loss_fn(call_one(i), i), params, allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g for g, p in zip(grads, params, strict=True)])
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return {n: torch.stack([r[k] for r in rows]) for k, n in enumerate(names)}


def _close(got, want):
    assert list(got) == list(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-9, msg=n)


FORMS = ["tuple", "dict", "model_kwargs", "batch_encoding"]


def _inputs(form, ids, mask, bias):
    if form == "tuple":
        return (ids, mask, bias), {}
    if form == "dict":
        return {"ids": ids, "attention_mask": mask, "bias": bias, "flag": True}, {}
    if form == "model_kwargs":
        return ids, {"attention_mask": mask, "bias": bias}
    from collections import UserDict  # a tokenizer's BatchEncoding is a UserDict

    return UserDict({"ids": ids, "attention_mask": mask, "bias": bias}), {}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("strategy", [*pv.STRATEGIES, "auto"])
def test_grads_with_masks_and_shared_tensors_equal_the_loop(form, strategy):
    model = MaskedEncoder().to(DT)
    ids, mask, bias, y = _data()
    loss = nn.CrossEntropyLoss()
    want = _loop_grads(model, lambda out, i: loss(out, y[i:i + 1]),
                       lambda i: model(ids[i:i + 1], attention_mask=mask[i:i + 1], bias=bias))
    inputs, kwargs = _inputs(form, ids, mask, bias)
    before = snapshot(model)
    got = pv.per_sample_grads(model, loss, inputs, y, strategy=strategy, model_kwargs=kwargs or None)
    _close(got, want)
    assert_state_unchanged(model, before)
    assert_no_hooks(model)
    flat = pv.per_sample_grads(model, loss, inputs, y, strategy=strategy, model_kwargs=kwargs or None,
                               flat=True, chunk_size=2)
    torch.testing.assert_close(flat, torch.cat([t.reshape(B, -1) for t in want.values()], 1), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("call", [*pv.STRATEGIES, "auto", "norms", "clipped_sum", "jacobian"])
def test_a_chunk_as_long_as_a_shared_tensor_passes_it_whole(call):
    """Found by a probe: with chunk_size=4, a chunk of 4 samples cut the shared (4, 4) bias per sample as if it were
    4 samples (rows 42-119% off under the loop and auto, silently; raw errors or a blamed strategy elsewhere)."""
    model, n, t = MaskedEncoder().to(DT), 8, 4
    g = torch.Generator().manual_seed(5)
    ids, mask = torch.randint(1, 11, (n, t), generator=g), torch.ones(n, t, dtype=torch.long)
    bias, y = torch.randn(t, t, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)
    loss = nn.CrossEntropyLoss()
    params = [p for p in model.parameters() if p.requires_grad]

    def one(i):
        return model(ids[i:i + 1], mask[i:i + 1], bias)

    if call == "jacobian":
        want = torch.stack([torch.cat([torch.autograd.grad(one(i)[0, k], params)[j].reshape(-1) for j in
                                       range(len(params))]) for i in range(n) for k in range(3)]).reshape(n, 3, -1)
        got = pv.per_sample_jacobian(model, (ids, mask, bias), flat=True, chunk_size=t)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
        return
    want = torch.stack([torch.cat([gi.reshape(-1) for gi in torch.autograd.grad(loss(one(i), y[i:i + 1]), params)])
                        for i in range(n)])
    if call == "norms":
        got = pv.per_sample_grad_norms(model, loss, (ids, mask, bias), y, chunk_size=t, strategy="loop")
        torch.testing.assert_close(got, want.norm(dim=1), rtol=1e-6, atol=1e-9)
    elif call == "clipped_sum":
        got = pv.clipped_grad_sum(model, loss, (ids, mask, bias), y, 0.05, chunk_size=t, strategy="loop")
        c = (0.05 / (want.norm(dim=1) + 1e-6)).clamp(max=1)
        torch.testing.assert_close(torch.cat([v.reshape(-1) for v in got.values()]), (c[:, None] * want).sum(0),
                                   rtol=1e-6, atol=1e-9)
    else:
        got = pv.per_sample_grads(model, loss, (ids, mask, bias), y, strategy=call, flat=True, chunk_size=t)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_the_ntks_x2_passes_whole_what_x1_passes_whole():
    """Found by a review: x2 of 4 samples beside x1's shared (4, 4) bias cut the bias per sample (refused as another
    kind of input)."""
    model, g = MaskedEncoder().to(DT), torch.Generator().manual_seed(6)
    ids1, ids2, bias = torch.randint(1, 11, (8, 4), generator=g), torch.randint(1, 11, (4, 4), generator=g), \
        torch.randn(4, 4, generator=g, dtype=DT)
    params = list(model.parameters())

    def jac(ids, i):
        out = model(ids[i:i + 1], torch.ones(1, 4, dtype=torch.long), bias)[0]
        return torch.stack([torch.cat([t.reshape(-1) for t in torch.autograd.grad(out[k], params, retain_graph=True)])
                            for k in range(3)])

    j1, j2 = torch.stack([jac(ids1, i) for i in range(8)]), torch.stack([jac(ids2, i) for i in range(4)])
    got = pv.empirical_ntk(model, (ids1, torch.ones(8, 4, dtype=torch.long), bias),
                           (ids2, torch.ones(4, 4, dtype=torch.long), bias), mode="trace")
    torch.testing.assert_close(got, torch.einsum("iyp,jyp->ij", j1, j2), rtol=1e-6, atol=1e-9)


def test_auto_keeps_the_fast_path_with_a_mask():
    model = MaskedEncoder().to(DT)
    ids, mask, bias, _ = _data()
    assert pv.resolve_strategy("auto", model, {"ids": ids, "attention_mask": mask, "bias": bias}) == "hooks"


@pytest.mark.parametrize("cls", [DictOutput, DataclassOutput])
@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func", "loop", "autograd_stack"])
def test_structured_outputs_for_losses_jacobians_norms(cls, strategy):
    model = cls().to(DT)
    ids, mask, bias, y = _data()

    def logits(out):
        return out["logits"] if isinstance(out, dict) else out.logits

    def loss(out, target):
        return nn.functional.cross_entropy(logits(out), target) + 0.1 * (
            out["hidden"] if isinstance(out, dict) else out.hidden).square().sum()

    inputs = {"ids": ids, "attention_mask": mask, "bias": bias}
    call_one = lambda i: model(ids[i:i + 1], mask[i:i + 1], bias)  # noqa: E731
    want = _loop_grads(model, lambda out, i: loss(out, y[i:i + 1]), call_one)
    _close(pv.per_sample_grads(model, loss, inputs, y, strategy=strategy), want)
    norms = pv.per_sample_grad_norms(model, loss, inputs, y, strategy=strategy)
    torch.testing.assert_close(norms, torch.stack([t.reshape(B, -1).square().sum(1) for t in want.values()])
                               .sum(0).sqrt(), rtol=1e-6, atol=1e-9)
    jac = pv.per_sample_jacobian(model, inputs, strategy=strategy, output=logits)
    for j in range(3):
        want_j = _loop_grads(model, lambda out, i, j=j: logits(out)[0, j], call_one)
        for n in want_j:
            torch.testing.assert_close(jac[n][:, j], want_j[n], rtol=1e-6, atol=1e-9)


def test_a_model_output_without_output_names_the_fix():
    model = DictOutput().to(DT)
    ids, mask, bias, _ = _data()
    with pytest.raises(TypeError, match=r"output=lambda out: out\['logits'\]"):  # a dict: no out.logits (a probe)
        pv.per_sample_jacobian(model, {"ids": ids, "attention_mask": mask})


def test_the_ntk_with_dict_inputs_equals_jacobian_products():
    model = MaskedEncoder().to(DT)
    ids, mask, bias, _ = _data()
    inputs = {"ids": ids, "attention_mask": mask, "bias": bias}
    jac = pv.per_sample_jacobian(model, inputs, strategy="loop", flat=True)
    got = pv.empirical_ntk(model, inputs)
    torch.testing.assert_close(got, torch.einsum("iyp,jzp->ijyz", jac, jac), rtol=1e-6, atol=1e-9)
    x2 = {"ids": ids[:2], "attention_mask": mask[:2], "bias": bias}
    torch.testing.assert_close(pv.empirical_ntk(model, inputs, x2), torch.einsum("iyp,jzp->ijyz", jac, jac[:2]),
                               rtol=1e-6, atol=1e-9)


def test_cut_takes_rows_of_batched_tensors_only():
    ids, mask, bias, y = _data()
    one = Batch.of({"ids": ids, "attention_mask": mask, "bias": bias, "flag": False}).sample(3)
    assert one.size == 1 and torch.equal(one.kwargs["ids"], ids[3:4]) and torch.equal(one.kwargs["bias"], bias)
    assert one.kwargs["flag"] is False
    assert torch.equal(cut({"y": y, "w": torch.ones(2)}, slice(1, 3), B)["y"], y[1:3])


def test_batch_sizes_that_disagree_name_the_tensors():
    model = MaskedEncoder().to(DT)
    ids, mask, bias, y = _data()
    with pytest.raises(ValueError, match="batch sizes differ.*ids.*attention_mask"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), {"ids": ids[:3], "attention_mask": mask[:3]}, y)
    with pytest.raises(ValueError, match="different numbers of samples"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), (ids, mask), {"a": y, "b": y[:2]})
    with pytest.raises(TypeError, match="tuple or list.*dict"):
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), "ids", y)


hf = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")


def _bert():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=16, num_labels=3)
    return BertForSequenceClassification(config).to(DT).eval()


@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func", "loop"])
def test_bert_with_an_attention_mask_as_a_tokenizer_gives_it(strategy):
    model = _bert()
    ids, mask, _, y = _data()
    loss = pv.sequence_classification_loss
    want = _loop_grads(model, lambda out, i: loss(out, y[i:i + 1]),
                       lambda i: model(input_ids=ids[i:i + 1], attention_mask=mask[i:i + 1]))
    try:
        got = pv.per_sample_grads(model, loss, {"input_ids": ids, "attention_mask": mask}, y, strategy=strategy)
    except pv.UnsupportedModelError as err:  # vmap cannot run BERT's mask code (data-dependent): said, not wrong
        assert strategy == "torch_func" and "strategy='auto'" in str(err)
        return
    _close(got, want)
    norms = pv.per_sample_grad_norms(model, loss, {"input_ids": ids, "attention_mask": mask}, y, strategy=strategy)
    torch.testing.assert_close(norms, torch.stack([t.reshape(B, -1).square().sum(1) for t in want.values()])
                               .sum(0).sqrt(), rtol=1e-6, atol=1e-9)


def test_the_readme_example_with_several_inputs_runs():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("Several inputs as models take them"):]
    code = section[section.index("```python\n") + 10:section.index("```\n", section.index("```python\n") + 10)]
    scope = {"torch": torch, "pv": pv}
    exec(code, scope)  # noqa: S102
    assert scope["J"].shape[:2] == (8, 3)
    first = next(iter(scope["grads"].values()))
    assert first.shape[0] == 8


class _Dicts(torch.utils.data.Dataset):
    """Items as a Hugging Face dataset yields them: {"ids", "attention_mask", "labels"}."""

    def __init__(self, ids, mask, y):
        self.ids, self.mask, self.y = ids, mask, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.y[i]}


def test_a_scan_of_a_dataset_yielding_dicts_equals_the_loop(tmp_path):
    model = MaskedEncoder().to(DT)
    ids, mask, bias, y = _data()
    loss = nn.CrossEntropyLoss()
    want = _loop_grads(model, lambda out, i: loss(out, y[i:i + 1]),
                       lambda i: model(ids[i:i + 1], attention_mask=mask[i:i + 1]))
    want_norms = torch.stack([t.reshape(B, -1).square().sum(1) for t in want.values()]).sum(0).sqrt()
    want_losses = torch.stack([loss(model(ids[i:i + 1], attention_mask=mask[i:i + 1]), y[i:i + 1]) for i in range(B)])
    scan = pv.scan(model, loss, _Dicts(ids, mask, y), quantities=("loss", "grad_norm"), batch_size=2,
                   out=tmp_path / "scan", progress=False)
    torch.testing.assert_close(torch.as_tensor(scan["grad_norm"]), want_norms, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(torch.as_tensor(scan["loss"]), want_losses.detach(), rtol=1e-6, atol=1e-9)


def test_an_output_reduced_over_the_batch_is_each_samples_under_auto():
    """output=lambda o: o.sum() on a (B,) output: per sample (the definition: output= of sample i alone) a scalar;
    of the batch, one number for all: the batched strategies refuse naming 'auto' / 'loop', and auto hands over."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 1), torch.nn.Flatten(0)).to(DT)
    x = torch.randn(3, 6, dtype=DT)
    want = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(x[i:i + 1]).sum(),
                                                                              list(model.parameters()))])
                        for i in range(3)]).unsqueeze(1)  # (B, 1, P)
    for strategy in ("auto", "loop", "torch_func"):
        got = pv.per_sample_jacobian(model, x, strategy=strategy, flat=True, output=lambda o: o.sum())
        torch.testing.assert_close(got, want)
    for strategy in ("hooks", "autograd_stack", "batched_grad"):
        with pytest.raises(pv.UnsupportedModelError, match=r"shape \(\) on a batch of \d.*strategy='auto'"):
            pv.per_sample_jacobian(model, x, strategy=strategy, output=lambda o: o.sum())


class _Scaled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, scale, x):
        return self.lin(x) * scale.sum()


@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func", "loop"])
def test_without_targets_a_shared_first_input_is_refused_before_the_model_runs(strategy):
    """Found by a probe: model(scale (2,), x (5, 3)) with targets=None gave 2 rows (B from the shared scale) and a
    clipped sum 0.47 off the 5 samples' loop, silently."""
    torch.manual_seed(0)
    model, scale, x = _Scaled(), torch.randn(2), torch.randn(5, 3)

    def energy(out, _):
        return out.pow(2).sum()

    with pytest.raises(ValueError, match=r"B = 2, and 'inputs\[1\]' \(5, 3\) would go whole.*put it first"):
        pv.per_sample_grads(model, energy, (scale, x), None, strategy=strategy)
    got = pv.per_sample_grads(_XFirst(model), energy, (x, scale), None, strategy=strategy)  # x first: 5 rows
    for i in range(5):
        want = torch.autograd.grad(energy(model(scale, x[i:i + 1]), None), model.lin.weight)[0]
        torch.testing.assert_close(got["inner.lin.weight"][i], want)


class _XFirst(torch.nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x, scale):
        return self.inner(scale, x)


@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func", "loop"])
@pytest.mark.parametrize("form", ["tuple", "dict"])
def test_targets_with_a_number_or_a_string_beside_the_tensor(strategy, form):
    """Found by a probe: torch_func (and auto where it got there) raised vmap's own in_dims error on (y, 0.5)."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 3), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    targets = (y, 0.5) if form == "tuple" else {"y": y, "mode": "double", "scale": 0.5}

    def loss_fn(out, t):
        y_, scale = (t[0], t[1]) if form == "tuple" else (t["y"], t["scale"] * (2 if t["mode"] == "double" else 1))
        return nn.functional.cross_entropy(out, y_) * scale

    got = pv.per_sample_grads(model, loss_fn, x, targets, strategy=strategy)
    for i in range(5):
        one = (y[i:i + 1], 0.5) if form == "tuple" else {"y": y[i:i + 1], "mode": "double", "scale": 0.5}
        want = torch.autograd.grad(loss_fn(model(x[i:i + 1]), one), model.weight)[0]
        torch.testing.assert_close(got["weight"][i], want)


def test_a_dataclass_input_names_its_fields():
    """Found by a probe: a dataclass of tensors was refused as 'a tuple holding no tensor', naming no fix."""

    @dataclasses.dataclass
    class Fields:
        x: torch.Tensor

    with pytest.raises(TypeError, match=r"a Fields dataclass is passed whole.*dataclasses\.asdict"):
        pv.per_sample_grads(nn.Linear(3, 2), nn.CrossEntropyLoss(), (Fields(torch.randn(4, 3)),),
                            torch.tensor([0, 1, 0, 1]))


@pytest.mark.parametrize("strategy", ["auto", "hooks", "torch_func", "loop"])
def test_a_0_dim_tensor_beside_the_targets_is_shared(strategy):
    """Found by a probe: (y, torch.tensor(0.3)) was refused as targets holding '[0, 5]' samples."""
    torch.manual_seed(0)
    model, x, y = nn.Linear(4, 3), torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    scale = torch.tensor(0.3)

    def loss_fn(out, t):
        return nn.functional.cross_entropy(out, t[0]) * t[1]

    got = pv.per_sample_grads(model, loss_fn, x, (y, scale), strategy=strategy)
    for i in range(5):
        want = torch.autograd.grad(loss_fn(model(x[i:i + 1]), (y[i:i + 1], scale)), model.weight)[0]
        torch.testing.assert_close(got["weight"][i], want)


@pytest.mark.parametrize("call", ["auto", "hooks", "torch_func", "loop", "jacobian", "norms", "clipped_sum", "ntk",
                                  "targets", "nested"])
def test_inputs_or_targets_computed_from_a_trainable_parameter_are_refused(call):
    """Found by a probe: inputs = model.fc1.weight[:6, :8] gave the loop (whose backward reaches fc1 through the
    inputs too) and auto / torch_func / the norms / the clipped sum (which do not) rows 0.15 apart, verify on."""
    torch.manual_seed(0)
    model, loss_fn = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)), nn.CrossEntropyLoss()
    x, y = model[0].weight[:6, :8], torch.randint(0, 3, (6,))
    before = snapshot(model)
    runs = {"jacobian": lambda: pv.per_sample_jacobian(model, x),
            "norms": lambda: pv.per_sample_grad_norms(model, loss_fn, x, y),
            "clipped_sum": lambda: pv.clipped_grad_sum(model, loss_fn, x, y, 1.0),
            "ntk": lambda: pv.empirical_ntk(model, x),
            "targets": lambda: pv.per_sample_grads(model, nn.MSELoss(), x.detach(), model(x.detach())),
            "nested": lambda: pv.per_sample_grads(_Keyed(model), loss_fn, ({"a": x},), y)}
    run = runs.get(call, lambda: pv.per_sample_grads(model, loss_fn, x, y, strategy=call))
    where = {"targets": "targets was computed from the model's trainable parameter '2.weight'",
             "nested": r"inputs\[0\]\['a'\] was computed from the model's trainable parameter 'inner.0.weight'"}
    with pytest.raises(ValueError, match=where.get(call, "inputs was computed from the model's trainable parameter "
                                                         "'0.weight'.*detach")):
        run()
    assert_state_unchanged(model, before)
    got = pv.per_sample_grads(model, loss_fn, x.detach(), y)  # the fix the message names: the inputs as constants
    for i in range(6):
        want = torch.autograd.grad(loss_fn(model(x[i:i + 1].detach()), y[i:i + 1]), model[0].weight)[0]
        torch.testing.assert_close(got["0.weight"][i], want)


class _Keyed(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, d):
        return self.inner(d["a"])
