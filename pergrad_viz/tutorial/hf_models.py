"""Tiny Hugging Face ``transformers``, ``timm`` and ``peft`` models, built from configs (nothing is downloaded).

Used by ``python -m pergrad_viz bench --model NAME`` (:mod:`pergrad_viz.bench.problems`) and notebook 06. Each
builder returns a module that takes ONE tensor and returns logits:

* text models take ``input_ids`` (B, T) int64 and return (B, T, vocab) (causal LMs) or (B, classes) (BERT);
* image models take ``pixel_values`` (B, C, H, W) and return (B, classes).

Hugging Face models return a ``ModelOutput``; :class:`Logits` wraps them so that ``model(x)`` is the logits tensor.
``transformers``, ``timm`` and ``peft`` are optional: they are imported inside the builders, never by
``import pergrad_viz``; a builder raises :class:`~pergrad_viz.errors.MissingExtraError` (an ImportError) naming
the extra ``hf`` when its library is missing.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch
from torch import nn

from pergrad_viz.core.extras import require
from pergrad_viz.core.users import FILTERS

HIDDEN = 128  # hidden size of every model here (timm ConvNeXt: the width of its last stage)
LAYERS = 2  # transformer blocks (ConvNeXt: one block in each of its four stages)
HEADS = 4
FEEDFORWARD = 4 * HIDDEN
VOCAB = 1000
TOKENS = 32  # longest sequence (position embeddings)
IMAGE = 32  # image side (pixels)
PATCH = 8


def _need(name: str) -> ModuleType:
    """Import an optional library, or a MissingExtraError (an ImportError) that names the extra ``hf``."""
    return require(name, "this Hugging Face / timm / peft model (pergrad_viz.tutorial.hf_models)")


class Logits(nn.Module):
    """A Hugging Face model called with one tensor as the keyword ``key`` (``input_ids``, ``pixel_values``),
    returning ``output.logits``: (B, T, vocab) for a causal LM, (B, classes) for a classifier."""

    def __init__(self, model: nn.Module, key: str):
        super().__init__()
        self.model = model
        self.key = key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(**{self.key: x}).logits


def gpt2(vocab: int = VOCAB) -> Logits:
    """GPT-2 LM (tied embedding / head, ``Conv1D`` projections), dropout off: (B, T) ids -> (B, T, vocab)."""
    t = _need("transformers")
    config = t.GPT2Config(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, n_inner=FEEDFORWARD, vocab_size=vocab,
                          n_positions=TOKENS, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                          eos_token_id=0)
    return Logits(t.GPT2LMHeadModel(config), "input_ids")


def llama(vocab: int = VOCAB) -> Logits:
    """Llama LM (RMSNorm, rotary positions, grouped-query attention 4 / 2 heads): (B, T) ids -> (B, T, vocab)."""
    t = _need("transformers")
    config = t.LlamaConfig(hidden_size=HIDDEN, intermediate_size=FEEDFORWARD, num_hidden_layers=LAYERS,
                           num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, vocab_size=vocab,
                           max_position_embeddings=TOKENS)
    return Logits(t.LlamaForCausalLM(config), "input_ids")


def bert(classes: int = 10, vocab: int = VOCAB) -> Logits:
    """BERT sequence classifier, dropout off: (B, T) ids -> (B, classes)."""
    t = _need("transformers")
    config = t.BertConfig(hidden_size=HIDDEN, intermediate_size=FEEDFORWARD, num_hidden_layers=LAYERS,
                          num_attention_heads=HEADS, vocab_size=vocab, max_position_embeddings=TOKENS,
                          num_labels=classes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Logits(t.BertForSequenceClassification(config), "input_ids")


def hf_vit(classes: int = 10, image: int = IMAGE, channels: int = 3, patch: int = PATCH, hidden: int = HIDDEN
           ) -> Logits:
    """Hugging Face ViT classifier (class token, position embeddings; ``hidden`` wide, feed-forward 4 x ``hidden``):
    (B, channels, image, image) -> (B, classes)."""
    t = _need("transformers")
    config = t.ViTConfig(image_size=image, patch_size=patch, num_channels=channels, hidden_size=hidden,
                         intermediate_size=4 * hidden, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_labels=classes)
    return Logits(t.ViTForImageClassification(config), "pixel_values")


def timm_vit(classes: int = 10, image: int = IMAGE, channels: int = 3, patch: int = PATCH) -> nn.Module:
    """timm VisionTransformer (``vit_tiny_patch16_224`` made smaller): (B, channels, image, image) -> (B, classes)."""
    timm = _need("timm")
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=classes, img_size=image,
                             patch_size=patch, in_chans=channels, embed_dim=HIDDEN, depth=LAYERS, num_heads=HEADS)


def convnext(classes: int = 10) -> nn.Module:
    """timm ConvNeXt (``convnext_atto`` made smaller: its four stages of one block each, widths 16, 32, 64, 128;
    LayerNorm2d, layer scale): (B, 3, H, W) -> (B, classes)."""
    timm = _need("timm")
    return timm.create_model("convnext_atto", pretrained=False, num_classes=classes, depths=(1, 1, 1, 1),
                             dims=(HIDDEN // 8, HIDDEN // 4, HIDDEN // 2, HIDDEN))


def lora(model: Logits, targets: tuple[str, ...], rank: int = 8, train_also: tuple[str, ...] = ()) -> Logits:
    """peft LoRA adapters (rank ``rank``, alpha 2 * rank, no dropout) on the layers named ``targets`` of a wrapped
    Hugging Face model; only the adapters stay trainable, and the modules named ``train_also`` (peft's
    ``modules_to_save``, e.g. a new classifier head). Returns ``model``, its inner model replaced."""
    peft = _need("peft")
    conv1d = "GPT2" in type(model.model).__name__  # GPT-2's Conv1D stores its weight (in, out)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(targets), lora_dropout=0.0,
                             fan_in_fan_out=conv1d, modules_to_save=list(train_also) or None)
    with FILTERS, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers' deprecation notices, read by peft
        model.model = peft.get_peft_model(model.model, config)
    return model


def lora_llama(rank: int = 8) -> Logits:
    """:func:`llama` with LoRA adapters on the attention's query and value projections."""
    return lora(llama(), ("q_proj", "v_proj"), rank)


def fashion_vit_lora(rank: int = 8, hidden: int = 64, classes: int = 10) -> Logits:
    """The tiny ViT of notebook 06 on Fashion-MNIST's (B, 1, 28, 28) images (7x7 patches: 16 and a class token;
    ``hidden`` wide, two blocks, four heads; no dropout), with LoRA adapters of rank ``rank`` on the attention's query
    and value projections and the classifier head trainable: (B, 1, 28, 28) -> (B, classes).

    peft starts every adapter's B at zero (so that the adapted model is the pretrained one), which makes the
    gradient of every A zero too; here each B gets nn.Linear's default random start instead (peft's
    ``init_lora_weights=False``), as after some fine-tuning, so that every adapter has a gradient to show. The
    attention is the plain ("eager") one: ``torch.func.vmap`` has no batching rule for the CPU's fused attention."""
    vit = hf_vit(classes=classes, image=28, channels=1, patch=7, hidden=hidden)
    vit.model.set_attn_implementation("eager")
    model = lora(vit, ("q_proj", "v_proj"), rank, train_also=("classifier",))
    for name, module in model.named_modules():
        if name.endswith("lora_B.default") and isinstance(module, nn.Linear):
            module.reset_parameters()
    return model


BUILDERS = {"gpt2": gpt2, "llama": llama, "bert": bert, "hf-vit": hf_vit, "timm-vit": timm_vit,
            "convnext": convnext, "lora-llama": lora_llama}
"""The bench's models by name (``bench --model NAME``)."""

CAUSAL_LM = ("gpt2", "llama", "lora-llama")
"""The models of :data:`BUILDERS` that are causal LMs: (B, T) ids -> (B, T, vocab), trained with
:func:`pergrad_viz.causal_lm_loss`."""

TEXT = (*CAUSAL_LM, "bert")
"""The models of :data:`BUILDERS` that take token ids (B, T)."""
