# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · Fine-tuning privately: a Hugging Face ViT with LoRA adapters, trained with DP-SGD
#
# Most people who need per-sample gradients hold a Hugging Face `transformers` model, a `timm` model or a `peft`
# adapter on one of them, and the most common reason is **differentially private fine-tuning** (DP-SGD): clip each
# example's gradient to a norm C, sum, add Gaussian noise of standard deviation sigma C, step. This notebook
#
# 1. builds a tiny Vision Transformer (Hugging Face `ViTForImageClassification`, from a config: nothing is
#    downloaded) and gives it a "pretrained" backbone by training it on five of the ten Fashion-MNIST classes;
# 2. puts LoRA adapters (`peft`) on its attention and fine-tunes adapters and head on all ten classes, twice from
#    the same start: plainly, and with per-sample clipping and noise from `pergrad_viz`;
# 3. follows the per-sample gradient norms of every adapted layer over the steps, and the fraction of examples
#    clipped, and compares the accuracies;
# 4. ends with a padded batch of text on a tiny GPT-2: the per-sample loss a causal LM needs.
#
# It needs `transformers`, `timm` and `peft` (the project's `hf` extra: `pip install -e '.[hf]'`).

# %%
# NBVAL_CHECK_OUTPUT
# %matplotlib inline
import copy
import re
import warnings

import matplotlib.pyplot as plt
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz.tutorial import hf_models
from pergrad_viz.tutorial.data import load_sample

warnings.filterwarnings("ignore", category=UserWarning)   # library chatter (peft, transformers)
warnings.filterwarnings("ignore", category=FutureWarning)
x, labels = load_sample(1000, flatten=False)                      # (1000, 1, 28, 28), (1000,)
x_test, labels_test = load_sample(1000, train=False, flatten=False)
print("train:", tuple(x.shape), "test:", tuple(x_test.shape))

# %% [markdown]
# ## 1 · A backbone to fine-tune
#
# Real fine-tuning starts from downloaded weights; here nothing is downloaded, so we make a backbone ourselves:
# a ViT with 7 x 7 patches (16 patches and a class token), hidden size 64, two blocks, trained plainly for a few
# epochs on the T-shirts, trousers, pullovers, dresses and coats (classes 0-4) only. It has never seen sandals,
# shirts, sneakers, bags or ankle boots.

# %%
torch.manual_seed(0)
vit = hf_models.hf_vit(classes=10, image=28, channels=1, patch=7, hidden=64)  # (B, 1, 28, 28) -> (B, 10)
loss_fn = nn.CrossEntropyLoss()


def accuracy(model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        return (model.eval()(images).argmax(1) == targets).float().mean().item()


seen = labels < 5
optimizer = torch.optim.Adam(vit.parameters(), lr=3e-3)
generator = torch.Generator().manual_seed(0)
vit.train()
for _ in range(8):
    for idx in torch.randperm(int(seen.sum()), generator=generator).split(50):
        xb, yb = x[seen][idx], labels[seen][idx]
        optimizer.zero_grad()
        loss_fn(vit(xb), yb).backward()
        optimizer.step()
seen_test = labels_test < 5
print(f"backbone: accuracy {accuracy(vit, x_test[seen_test], labels_test[seen_test]):.2f} on test classes 0-4, "
      f"{accuracy(vit, x_test, labels_test):.2f} on all ten")

# %% [markdown]
# ## 2 · LoRA adapters, and two ways to train them
#
# `peft` adds a low-rank update B A (rank 8) next to the query and value projections of both blocks and freezes
# everything else; the classifier head stays trainable (`modules_to_save`). `hf_models.lora` is three lines of `peft`.
# `pv.per_sample_grads` sees the trainable parameters only: the adapters and the head, under 5,000 numbers per
# example instead of the model's 110,000.

# %%
# NBVAL_CHECK_OUTPUT
model = hf_models.lora(vit, ("q_proj", "v_proj"), rank=8, train_also=("classifier",))
trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
print(f"{len(trainable)} trainable tensors, {sum(p.numel() for p in trainable.values()):,} numbers; "
      f"the model has {sum(p.numel() for p in model.parameters()):,}")


def layer_of(name: str) -> str:
    """'block 0 q' for block 0's query adapter (its A and B), ..., 'head' for the classifier."""
    found = re.search(r"layers\.(\d+)\.attention\.(q|v)_proj", name)
    return f"block {found[1]} {found[2]}" if found else "head"


print(sorted({layer_of(n) for n in trainable}))

# %% [markdown]
# One training loop for both runs. Each step computes the per-sample gradients `{name: (B, *shape)}` of the batch
# (plain training only needs their sum, the ordinary batch gradient, but we want to watch the norms in both runs):
#
# * **plain**: the gradient is the mean of the per-sample gradients;
# * **private**: `pv.dp_sgd_gradient` clips each example's gradient (over all its parameters jointly) to norm C,
#   sums, and adds N(0, (sigma C)^2) noise; we divide by the batch size.
#
# Per step we log, for each layer, the median over the batch of the per-sample gradient norm, and the fraction of
# examples whose whole gradient is longer than C (clipped in the private run; "would be clipped" in the plain one).

# %%
C, SIGMA, BATCH, EPOCHS = 1.0, 0.8, 100, 4


def fine_tune(model: nn.Module, private: bool, seed: int = 0) -> dict[str, list]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.Adam(params.values(), lr=1e-2)
    generator = torch.Generator().manual_seed(seed)
    log = {"norms": [], "clipped": []}
    model.train()
    for _ in range(EPOCHS):
        for idx in torch.randperm(len(x), generator=generator).split(BATCH):
            grads = pv.per_sample_grads(model, loss_fn, x[idx], labels[idx])           # {name: (B, *shape)}
            squares = {}                                                                 # layer -> (B,) norm^2
            for name, g in grads.items():
                squares[layer_of(name)] = squares.get(layer_of(name), 0) + g.flatten(1).pow(2).sum(1)
            total = sum(squares.values()).sqrt()                                         # (B,)
            log["norms"].append({layer: s.sqrt().median().item() for layer, s in squares.items()})
            log["clipped"].append((total > C).float().mean().item())
            if private:
                summed = pv.dp_sgd_gradient(grads, max_norm=C, noise_multiplier=SIGMA, generator=generator)
            else:
                summed = {name: g.sum(0) for name, g in grads.items()}
            for name, p in params.items():
                p.grad = summed[name] / len(idx)
            optimizer.step()
    return log


plain_model, private_model = copy.deepcopy(model), copy.deepcopy(model)    # the same start
plain = fine_tune(plain_model, private=False)
private = fine_tune(private_model, private=True)
print(f"{len(plain['clipped'])} steps each, batches of {BATCH}, C = {C}, sigma = {SIGMA}")

# %% [markdown]
# ## 3 · What the per-sample gradients did
#
# Left and middle: the median per-sample gradient norm of each adapted layer (adapter A and B together) and of the
# head, step by step. Right: the fraction of each batch longer than C.

# %%
fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharex=True, layout="constrained")
for ax, (title, log) in zip(axes[:2], (("plain fine-tuning", plain), ("DP fine-tuning", private)), strict=True):
    for layer in sorted(log["norms"][0]):
        ax.plot([step[layer] for step in log["norms"]], label=layer)
    ax.set(title=title, xlabel="step", ylabel="median per-sample gradient norm", yscale="log")
low, high = min(ax.get_ylim()[0] for ax in axes[:2]), max(ax.get_ylim()[1] for ax in axes[:2])
axes[0].set_ylim(low, high), axes[1].set_ylim(low, high)
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncol=5, fontsize="small")
axes[2].plot(plain["clipped"], label="plain (would be clipped)")
axes[2].plot(private["clipped"], label="private (clipped)")
axes[2].set(title=f"fraction of the batch with norm > C = {C:g}", xlabel="step", ylim=(0, 1.05))
axes[2].legend(fontsize="small", loc="lower right")
plt.show()

# %% [markdown]
# The head carries most of the norm (its classes 5-9 are new to it); the adapters' B matrices start at zero, so
# their norms grow as they learn. C = 1 is below most examples' norms, so nearly every example is clipped (the
# usual regime of DP-SGD): each moves the model by at most C, and the noise, sigma C per step for the whole batch,
# hides any single one. Accuracy on the test images, where only the plain run's numbers are free of noise:

# %%
before = accuracy(model, x_test, labels_test)
plain_acc, private_acc = accuracy(plain_model, x_test, labels_test), accuracy(private_model, x_test, labels_test)
print(f"test accuracy on all ten classes: backbone {before:.2f}, plain LoRA {plain_acc:.2f}, "
      f"DP LoRA {private_acc:.2f}")

# %%
# NBVAL_CHECK_OUTPUT
print("both fine-tunings beat the backbone:", min(plain_acc, private_acc) > before)
print("privacy costs accuracy (plain >= private):", plain_acc >= private_acc)

# %% [markdown]
# How private? That is an accountant's answer, not a gradient's: with Poisson-sampled batches of expected size B
# out of N examples, `opacus.accountants.RDPAccountant` turns sigma, B / N and the number of steps into
# (epsilon, delta). This demo draws shuffled batches instead, so it shows the mechanics, not a guarantee.
#
# ## 4 · A padded batch of text: the per-sample loss of a causal LM
#
# Texts in a batch have different lengths: the short ones are padded, and the padded positions get the label
# `-100` (no target). `pv.causal_lm_loss` shifts the labels by one, as Hugging Face's models do, and takes each
# sample's **own** mean over its non-ignored tokens: the loss of sample i run alone. (Hugging Face's
# `model(..., labels=...)` returns the batch's token mean instead, which weighs a long text more than a short one
# and is not a sum of per-sample losses; `cross_entropy` ignores -100 by default.) A tiny GPT-2, from a config:

# %%
torch.manual_seed(0)
lm = hf_models.gpt2().eval()                                           # (B, T) token ids -> (B, T, 1000) logits
lengths = torch.tensor([12, 7, 10])
ids = torch.randint(1, 1000, (3, 12), generator=torch.Generator().manual_seed(0))
padding = torch.arange(12) >= lengths[:, None]                      # (3, 12) True after each text's end
ids = ids.masked_fill(padding, 0)                                   # right padding with token 0
labels_lm = ids.masked_fill(padding, -100)                          # no target on padding
attention_mask = (~padding).long()                                  # what a tokenizer returns beside the ids
print(labels_lm)

# %%
# NBVAL_CHECK_OUTPUT
with torch.no_grad():
    logits = lm(ids)                                                               # (3, 12, 1000)
    per_sample = pv.causal_lm_loss(logits, labels_lm, reduction="none")           # (3,)
    alone = torch.stack([pv.causal_lm_loss(lm(ids[i:i + 1, :n]), labels_lm[i:i + 1, :n])
                         for i, n in enumerate(lengths.tolist())])
    token_mean = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels_lm[:, 1:].flatten())
print("per-sample losses == each text run alone, unpadded:", torch.allclose(per_sample, alone, atol=1e-5))
print("the batch's token mean is not the mean of the per-sample losses:",
      not torch.allclose(token_mean, per_sample.mean(), atol=1e-4))

# %% [markdown]
# The per-sample gradients of that loss. GPT-2 is causal: a token attends only to the tokens before it, so padding
# on the right changes nothing at the real tokens, and the gradient of the 7-token text equals its gradient run
# alone. The batch goes in as a tokenizer returns it, ids and attention mask in a dict (`model(**batch)`): with
# padding on the left, or a model that attends both ways (BERT), the mask is what keeps the padding out.

# %%
# NBVAL_CHECK_OUTPUT
batch = {"input_ids": ids, "attention_mask": attention_mask}       # as a tokenizer gives it: model(**batch)
grads = pv.per_sample_grads(lm.model, pv.causal_lm_loss, batch, labels_lm, flat=True)  # (3, P)
short = pv.per_sample_grads(lm.model, pv.causal_lm_loss, ids[1:2, :7], labels_lm[1:2, :7], flat=True)
print(f"per-sample gradients {tuple(grads.shape)}; the padded text's == its gradient alone:",
      torch.allclose(grads[1], short[0], atol=1e-6))
