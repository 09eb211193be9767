"""Tiny Hugging Face transformers, peft and timm models, built from configs (nothing downloaded): per-sample gradients
of strategy="auto" equal the float64 loop per sample, and the layer types with closed-form rules
(pergrad_viz.rules.integrations) take them instead of the per-layer fallback. Single-tensor inputs (input_ids or
pixel_values); flat=False (flat=True on some of these is the engine's, tested elsewhere)."""

from __future__ import annotations

import functools
import os

import pytest
import torch
from helpers import assert_dict_close, flatten_ref, ref_grads
from torch import nn

import pergrad_viz as pv
from pergrad_viz.core.trainable import Trainable
from pergrad_viz.errors import UnsupportedModelError
from pergrad_viz.strategies.hooks import describe
from pergrad_viz.tutorial.hf_models import Logits

os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may come from a hub
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]
B = 3
TOL = {"rtol": 1e-9, "atol": 1e-11}
# Layer types that have a closed-form rule here: none of them may go to the per-layer fallback.
RULED = {"Conv1D", "LlamaRMSNorm", "LayerNorm", "LayerNorm2d", "BatchNormAct2d", "LayerScale", "LayerScale2d",
         "ConvNeXtBlock", "Linear", "Embedding", "Conv2d"}


def need(name: str):
    return pytest.importorskip(name, reason=f"{name} is not installed (pip install {name}): these models need it")


def gpt2() -> nn.Module:
    t = need("transformers")
    config = t.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100, n_positions=32, resid_pdrop=0.0,
                          embd_pdrop=0.0, attn_pdrop=0.0)
    model = t.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight  # the tied head
    return Logits(model, "input_ids")


def llama() -> nn.Module:
    t = need("transformers")
    config = t.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=100, max_position_embeddings=32)
    return Logits(t.LlamaForCausalLM(config), "input_ids")


def bert() -> nn.Module:
    t = need("transformers")
    config = t.BertConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                          vocab_size=100, max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    return Logits(t.BertForSequenceClassification(config), "input_ids")


def hf_vit() -> nn.Module:
    t = need("transformers")
    config = t.ViTConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_labels=3)
    return Logits(t.ViTForImageClassification(config), "pixel_values")


def lora(base, targets: list[str], dropout: float = 0.0) -> nn.Module:
    peft = need("peft")
    wrapped = base()
    gpt = "GPT2" in type(wrapped.model).__name__  # GPT-2's Conv1D stores its weight (in, out)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=dropout, fan_in_fan_out=gpt)
    wrapped.model = peft.get_peft_model(wrapped.model, config)
    return wrapped


def timm_model(name: str, **kwargs) -> nn.Module:
    return need("timm").create_model(name, pretrained=False, num_classes=3, **kwargs)


MODELS = {  # name -> (builder, inputs kind, layer types expected on the per-layer fallback: the engine's patterns,
    #                  layer types whose parameters (1, ...) take per-sample copies: pergrad_viz.engine.broadcast)
    "gpt2": (gpt2, "lm", set(), set()),  # wpe on position ids (1, T): its output spread (engine.broadcast)
    "bert": (bert, "cls", set(), set()),  # the position embeddings on ids (1, T): the same
    "llama": (llama, "lm", set(), set()),
    "hf-vit": (hf_vit, "image", set(), {"ViTEmbeddings"}),  # class token and position embeddings
    "lora-gpt2": (lambda: lora(gpt2, ["c_attn"]), "lm", set(), set()),
    "lora-llama": (lambda: lora(llama, ["q_proj", "v_proj"]), "lm", set(), set()),
    "timm-vit": (lambda: timm_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), "image",
                 set(), {"VisionTransformer"}),  # cls_token, pos_embed
    "deit": (lambda: timm_model("deit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), "image",
             set(), {"VisionTransformer"}),
    "convnext": (lambda: timm_model("convnext_atto"), "image", set(), set()),  # the block's gamma: a rule
    "efficientnet": (lambda: timm_model("efficientnet_b0"), "image", set(), set()),
}


def batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if kind == "lm":
        x = torch.randint(0, 100, (B, 8), generator=g)
        y = x.clone()
        y[1, 5:] = -100  # a sample with fewer targets: its own token mean
        return x, y
    if kind == "cls":
        return torch.randint(0, 100, (B, 8), generator=g), torch.randint(0, 3, (B,), generator=g)
    return torch.randn(B, 3, 32, 32, generator=g, dtype=torch.float64), torch.randint(0, 3, (B,), generator=g)


def build(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor, object, set]:
    make, kind, fallback, _ = MODELS[name]
    torch.manual_seed(0)
    model = make().double().eval()
    x, y = batch(kind)
    loss = pv.causal_lm_loss if kind == "lm" else nn.CrossEntropyLoss()
    return model, x, y, loss, fallback


@pytest.mark.parametrize("name", list(MODELS))
def test_per_sample_grads_equal_the_loop(name):
    model, x, y, loss, fallback = build(name)
    if name.startswith("lora"):
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)  # only the adapters
    assert pv.resolve_strategy("auto", model, x) == "hooks"
    modules = dict(model.named_modules())
    kinds = describe(Trainable.of(model), x)
    on_fallback = {type(modules[n]).__name__ for n, kind in kinds.items() if kind == "fallback"}
    assert on_fallback == fallback and not on_fallback & RULED
    assert {type(modules[n]).__name__ for n, kind in kinds.items() if kind == "broadcast"} == MODELS[name][3]
    want = ref_grads(model, loss, x, y)
    got = pv.per_sample_grads(model, loss, x, y, strategy="auto", flat=False)
    assert_dict_close(got, want, **TOL)
    flat = pv.per_sample_grads(model, loss, x, y, strategy="hooks", flat=True)  # crashed on tied / fallback layers
    torch.testing.assert_close(flat, flatten_ref(want, 1), **TOL)
    out = torch.full_like(flat, float("nan"))
    assert pv.per_sample_grads(model, loss, x, y, flat=True, out=out) is out
    torch.testing.assert_close(out, flatten_ref(want, 1), **TOL)


def test_conv1d_ghost_norms_in_gpt2():
    model, x, y, loss, _ = build("gpt2")
    want = {n: g.flatten(1).norm(dim=1) for n, g in ref_grads(model, loss, x, y).items()}
    got = pv.per_sample_grad_norms(model, loss, x, y, per_parameter=True)
    assert_dict_close(got, want, **TOL)


def test_lora_dropout_in_training_is_refused():
    model = lora(gpt2, ["c_attn"], dropout=0.1).double().train()
    x, y = batch("lm")
    with pytest.raises(UnsupportedModelError, match="lora_dropout"):
        pv.per_sample_grads(model, pv.causal_lm_loss, x, y)


def test_labels_in_the_inputs_and_a_modeloutput_loss_name_the_fast_path():
    """Found by a newcomer probe: loss_fn=lambda out, t: out.loss with the labels inside the inputs made auto compute
    each sample alone (15x slower), silently, hooks' refusal naming no fix; nn.CrossEntropyLoss() on the
    ModelOutput gave PyTorch's TypeError alone."""
    t = need("transformers")
    torch.manual_seed(0)
    model = t.BertForSequenceClassification(t.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=50,
        max_position_embeddings=16, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)).eval()
    ids, labels = torch.randint(1, 50, (4, 6)), torch.randint(0, 2, (4,))
    with pytest.raises(pv.UnsupportedModelError, match="pass the labels as targets instead.*sequence_classification"):
        pv.per_sample_grads(model, lambda out, y: out.loss, {"input_ids": ids, "labels": labels}, labels,
                            strategy="hooks")
    with pytest.raises(TypeError) as info:
        pv.per_sample_grads(model, nn.CrossEntropyLoss(), {"input_ids": ids}, labels)
    assert "pv.sequence_classification_loss" in "\n".join(getattr(info.value, "__notes__", []))
    got = pv.per_sample_grads(model, pv.sequence_classification_loss, {"input_ids": ids}, labels, strategy="hooks")
    name, p = "classifier.weight", model.classifier.weight
    for i in range(4):  # the fix it names: the fast path, the loop's numbers
        want = torch.autograd.grad(model(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss, p)[0]
        torch.testing.assert_close(got[name][i], want)


@pytest.mark.parametrize("problem", ["regression", "multi_label_classification"])
def test_sequence_classification_loss_is_the_heads_own_for_regression_and_several_labels(problem):
    """Found by a probe: a regression head (num_labels=1) got cross-entropy over one class, 0 for every sample (all
    gradients zero, silently), or with float labels a raw dtype error; Hugging Face's own loss is the squared error
    there, and the binary cross-entropy for several float labels a sample. Against its own loss, sample by sample."""
    t = need("transformers")
    torch.manual_seed(0)
    classes = 1 if problem == "regression" else 3
    model = t.BertForSequenceClassification(t.BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=50,
        max_position_embeddings=16, num_labels=classes, problem_type=problem, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)).eval().double()
    ids = torch.randint(1, 50, (4, 6))
    labels = torch.randn(4, dtype=torch.float64) if classes == 1 else (torch.rand(4, classes) > 0.5).double()
    got = pv.per_sample_grads(model, pv.sequence_classification_loss, {"input_ids": ids}, labels, flat=True)
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(4):
        want = torch.autograd.grad(model(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss, params)
        torch.testing.assert_close(got[i], torch.cat([g.reshape(-1) for g in want]), rtol=1e-9, atol=1e-12)
    assert got.norm(dim=1).min() > 0


@pytest.mark.parametrize(("classes", "problem"), [(1, "multi_label_classification"), (3, "regression")])
def test_sequence_classification_loss_takes_the_heads_problem_type(classes, problem):
    """Found by a probe: a head whose config names another problem type than Hugging Face's rule by shapes gives
    (one multi-label class, a regression of three values) got the other loss; problem_type= names it."""
    t = need("transformers")
    torch.manual_seed(0)
    model = t.BertForSequenceClassification(t.BertConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=50,
        max_position_embeddings=16, num_labels=classes, problem_type=problem)).eval().double()
    ids = torch.randint(1, 50, (4, 6))
    labels = torch.randn(4, classes, dtype=torch.float64) if problem == "regression" else \
        (torch.rand(4, classes) > 0.5).double()
    loss_fn = functools.partial(pv.sequence_classification_loss, problem_type=model.config.problem_type)
    got = pv.per_sample_grads(model, loss_fn, {"input_ids": ids}, labels, flat=True)
    params = [p for p in model.parameters() if p.requires_grad]
    for i in range(4):
        want = torch.autograd.grad(model(input_ids=ids[i:i + 1], labels=labels[i:i + 1]).loss, params)
        torch.testing.assert_close(got[i], torch.cat([g.reshape(-1) for g in want]), rtol=1e-9, atol=1e-12)
    with pytest.raises(ValueError, match="problem_type must be one of"):
        pv.sequence_classification_loss(torch.zeros(2, 3), torch.zeros(2, 3), problem_type="multi")
