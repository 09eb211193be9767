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
# # 06 · Fine-tuning privately: every parameter of a Hugging Face ViT, with DP-SGD and its (epsilon, delta)
#
# The most common reason to want per-sample gradients is **differentially private fine-tuning** (DP-SGD): clip
# each example's gradient to norm C, sum, add Gaussian noise of standard deviation sigma C, step. Done naively it
# needs the (B, P) per-sample gradients, one row per example and one column per parameter: fine for a few
# thousand adapter weights, out of reach for full fine-tuning (BERT-base at B = 32 would be 14 GB of float32).
# `pergrad_viz` forms the clipped sum without them. This notebook
#
# 1. builds a tiny Vision Transformer (Hugging Face `ViTForImageClassification`, from a config: nothing is
#    downloaded) and gives it a "pretrained" backbone by training it on five of the ten Fashion-MNIST classes;
# 2. fine-tunes **all** its parameters on the ten classes twice from the same start, on the same batches: plainly,
#    and privately with `pv.dp_step` on Poisson-sampled batches (`pv.PoissonBatches`), its noise chosen by the
#    accountant for a target epsilon, and epsilon printed epoch by epoch;
# 3. measures what one DP step costs next to a plain step, in time and peak memory, and next to the two other
#    ways to get the same numbers: materialised per-sample gradients, and Opacus' ghost clipping;
# 4. takes the same DP step on LoRA adapters alone, and ends with a padded batch of text on a tiny GPT-2.
#
# It needs `transformers` and `peft` (the `hf` extra) and Opacus' accountant (the `dp` extra):
# `pip install -e '.[hf,dp]'`.

# %%
# NBVAL_CHECK_OUTPUT
# %matplotlib inline
import copy
import warnings

import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz import viz
from pergrad_viz.bench import dp as bench_dp
from pergrad_viz.tutorial import hf_models
from pergrad_viz.tutorial.data import load_sample

warnings.filterwarnings("ignore", category=UserWarning)   # library chatter (peft, transformers, Opacus' search)
warnings.filterwarnings("ignore", category=FutureWarning)
torch.set_num_threads(1)                  # tiny models: more threads only add overhead (and spin on a busy machine)
images, classes = load_sample(1000, flatten=False)                # (1000, 1, 28, 28), (1000,)
x, labels = images[:500], classes[:500]                            # the private data: fine-tuning only
x_public, labels_public = images[500:], classes[500:]              # the "public" data: the backbone only
x_test, labels_test = load_sample(1000, train=False, flatten=False)
print("private:", tuple(x.shape), "public:", tuple(x_public.shape), "test:", tuple(x_test.shape))

# %% [markdown]
# ## 1 · A backbone to fine-tune
#
# Real fine-tuning starts from downloaded weights; here nothing is downloaded, so we make a backbone ourselves:
# a ViT with 7 x 7 patches (16 patches and a class token), hidden size 32, two blocks, trained plainly for 20
# epochs on the T-shirts, trousers, pullovers, dresses and coats (classes 0-4) of the other 500 training images,
# the "public" ones, which the private fine-tuning never sees. It has never seen sandals, shirts, sneakers, bags or
# ankle boots. (The attention is the plain, "eager" one: the materialised route of
# section 3 runs `torch.func.vmap`, which has no batching rule for the CPU's fused attention.)

# %%
torch.manual_seed(0)
vit = hf_models.hf_vit(classes=10, image=28, channels=1, patch=7, hidden=32)  # (B, 1, 28, 28) -> (B, 10)
vit.model.set_attn_implementation("eager")
loss_fn = nn.CrossEntropyLoss()


def accuracy(model: nn.Module, images: torch.Tensor, targets: torch.Tensor) -> float:
    with torch.no_grad():
        return (model.eval()(images).argmax(1) == targets).float().mean().item()


seen = labels_public < 5
x_seen, labels_seen = x_public[seen], labels_public[seen]
optimizer = torch.optim.Adam(vit.parameters(), lr=3e-3)
generator = torch.Generator().manual_seed(0)
vit.train()
for _ in range(EPOCHS_BACKBONE := 20):
    for idx in torch.randperm(len(x_seen), generator=generator).split(50):
        optimizer.zero_grad()
        loss_fn(vit(x_seen[idx]), labels_seen[idx]).backward()
        optimizer.step()
seen_test = labels_test < 5
backbone_acc = accuracy(vit, x_test, labels_test)
print(f"backbone: accuracy {accuracy(vit, x_test[seen_test], labels_test[seen_test]):.2f} on test classes 0-4, "
      f"{backbone_acc:.2f} on all ten; {sum(p.numel() for p in vit.parameters()):,} parameters")

# %% [markdown]
# ## 2 · Full fine-tuning, plain and private
#
# The guarantee of DP-SGD is about a mechanism, and three things make it one here:
#
# * **Poisson sampling**: each step's batch holds each of the N = 500 private examples independently with
#   probability q = 0.1 (`pv.PoissonBatches`, drawn from a seeded generator of its own), so a batch's size varies
#   around q N = 50; the step divides by that expected size, as Opacus does, never by the batch's own size;
# * **the clipped, noised sum**: `pv.dp_step` puts `(sum_i min(1, C / ||g_i||) g_i + N(0, (sigma C)^2 I)) / (q N)`
#   into every trainable parameter's `.grad`, for any `torch.optim` optimiser; it runs one hooked forward and one
#   backward, takes each layer's per-sample norms from the inputs and output gradients it captured, and forms the
#   sum as one weighted product per layer: never the (B, P) matrix (an empty batch still takes its step of noise,
#   `pv.noise_step`, so that the steps released are the steps counted);
# * **the accountant** (Opacus' RDP accountant, never written here): `pv.noise_multiplier_for` gives the noise
#   multiplier sigma whose 5 epochs (50 steps) stay within epsilon = 8 at delta = 1e-5 (below 1 / N), and
#   `pv.epsilon` the epsilon spent after each epoch.

# %%
# NBVAL_CHECK_OUTPUT
N, Q, EPOCHS, C, DELTA, TARGET_EPSILON = len(x), 0.1, 5, 1.0, 1e-5, 8.0
steps_per_epoch = len(pv.PoissonBatches(N, Q, generator=torch.Generator()))
SIGMA = pv.noise_multiplier_for(TARGET_EPSILON, Q, EPOCHS * steps_per_epoch, DELTA)
print(f"q = {Q}, {steps_per_epoch} steps an epoch, C = {C}: sigma = {SIGMA:.3f} for epsilon <= {TARGET_EPSILON:g} "
      f"at delta = {DELTA:g} after {EPOCHS} epochs")
for epoch in range(1, EPOCHS + 1):
    spent = pv.epsilon(SIGMA, Q, epoch * steps_per_epoch, DELTA)
    print(f"  after epoch {epoch} ({epoch * steps_per_epoch:2d} steps): epsilon = {spent:.2f}, delta = {DELTA:g}")

# %% [markdown]
# One loop for both runs, on the same batches (the sampler's generator has the same seed in both; the noise
# comes from a generator of its own). The plain run uses Adam, as the backbone did. The private run uses plain
# SGD with a large step (lr 0.5, picked by a small sweep on this data): its gradient is a mean of clipped
# gradients, at most C = 1 long whatever the loss, plus noise that Adam's per-coordinate scaling would enlarge.
# After each epoch: the loss on the whole training set and the accuracy on the test images.

# %%
def fine_tune(model: nn.Module, private: bool) -> list[dict]:
    batches = pv.PoissonBatches(N, Q, generator=torch.Generator().manual_seed(0))  # the same batches in both runs
    noise = torch.Generator().manual_seed(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5) if private else \
        torch.optim.Adam(model.parameters(), lr=3e-3)
    log = []
    for epoch in range(1, EPOCHS + 1):
        model.train()
        for idx in batches:                                                   # a list of indices, of varying length
            optimizer.zero_grad()
            if private and idx:
                pv.dp_step(model, loss_fn, x[idx], labels[idx], C, noise_multiplier=SIGMA, generator=noise,
                           expected_batch_size=batches.expected_batch_size)  # .grad: the DP-SGD gradient
            elif private:
                pv.noise_step(model, C, noise_multiplier=SIGMA, generator=noise,
                              expected_batch_size=batches.expected_batch_size)
            elif idx:
                loss_fn(model(x[idx]), labels[idx]).backward()
            optimizer.step()
        with torch.no_grad():
            train_loss = loss_fn(model.eval()(x), labels).item()
        log.append({"loss": train_loss, "accuracy": accuracy(model, x_test, labels_test),
                    "epsilon": pv.epsilon(SIGMA, Q, epoch * len(batches), DELTA) if private else float("inf")})
    return log


plain_model, private_model = copy.deepcopy(vit), copy.deepcopy(vit)       # the same start
plain, private = fine_tune(plain_model, private=False), fine_tune(private_model, private=True)
sizes = [len(b) for b in pv.PoissonBatches(N, Q, generator=torch.Generator().manual_seed(0))]
print(f"batch sizes of an epoch: {min(sizes)} to {max(sizes)} (expected {Q * N:g}); every parameter trained")
print(f"{'epoch':>5} | {'plain loss':>10} {'accuracy':>8} | {'DP loss':>8} {'accuracy':>8} {'epsilon':>8}")
for epoch, (p, d) in enumerate(zip(plain, private, strict=True), start=1):
    print(f"{epoch:>5} | {p['loss']:>10.3f} {p['accuracy']:>8.3f} | {d['loss']:>8.3f} {d['accuracy']:>8.3f} "
          f"{d['epsilon']:>8.2f}")
print(f"backbone before fine-tuning: test accuracy {backbone_acc:.3f} (delta = {DELTA:g} throughout)")

# %%
# NBVAL_CHECK_OUTPUT
print("both fine-tunings beat the backbone:", min(plain[-1]["accuracy"], private[-1]["accuracy"]) > backbone_acc)
print(f"the private run's epsilon after {EPOCHS} epochs is within {TARGET_EPSILON:g}:",
      private[-1]["epsilon"] <= TARGET_EPSILON)

# %% [markdown]
# What these numbers are: the private model is (epsilon, delta)-DP with respect to one example of the 500 private
# ones (added or removed), epsilon as printed, delta = 1e-5, for this sampling, clip and noise, by the RDP
# accountant's bound; the backbone is public (its 500 images are not among them), as downloaded weights would be.
# On 500 examples privacy is expensive: the noise is the same whatever the data set's size while the signal grows
# with it, which is why the private run learns less than the plain one; real DP fine-tuning uses data sets tens or
# hundreds of times larger.
#
# ## 3 · What a DP step costs
#
# `bench.dp.dp_rows` (the functions of `python -m pergrad_viz bench --dp`) times one step on a batch of 32 of the
# private model in interleaved rounds: a plain forward+backward (the cost to beat); `pv.clipped_grad_sum` (with its
# per-call check), then with the noise `pv.dp_step` adds, and with `verify=False`; the noise alone (drawn the same
# whatever computes the sum); the per-sample gradients materialised (`pv.per_sample_grads`, then clipped and summed by
# `pv.dp_sgd_gradient`); and Opacus' ghost clipping (`GradSampleModuleFastGradientClipping`: norms first, then a
# second backward of the reweighted loss), which like the rows without noise computes the noiseless sum.
# The peak is the memory a step adds above what the process held before it (the resident set on a Linux CPU; the
# allocator's peak on CUDA); `max |diff|` compares each noiseless clipped sum with the plain loop's. The noise rows
# draw at sigma = 1 (what the noise costs does not depend on sigma). **The output below was measured when the cell
# last ran (in the committed notebook: when it was built, on one thread of a shared 2-core CPU)**: noisy (a row
# marked NOISY spread by more than a quarter of its median), and small at this size; run the cell to measure yours.
# The table's ratios are the median of each round's own ratio, the figure's the ratio of the medians: on a busy
# machine they differ a little.

# %%
rows = bench_dp.dp_rows(private_model, loss_fn, x[:32], labels[:32], rounds=5)
print(f"measured when this cell ran: {torch.get_num_threads()} thread(s), torch {torch.__version__}, CPU")
print(bench_dp.format_dp_table("the tiny ViT, all parameters", rows, 32))
params = sum(p.numel() for p in private_model.parameters())
print(f"the (B, P) matrix the materialised route builds: 32 x {params:,} floats = {32 * params * 4 / 2**20:.1f} MB")
viz.dp_cost_figure(rows, title="one DP-SGD step of the tiny ViT (all 28k parameters), B = 32, this CPU")

# %% [markdown]
# At this size the (B, P) matrix is small (the line under the table), so materialising it costs little: that
# route can be as fast as the clipped sum here, or faster. What rules it out for full fine-tuning of a real model
# is its memory, which grows as B times P, while the clipped sum's extra memory grows with the activations a
# plain backward keeps anyway. `python -m pergrad_viz bench --dp`
# prints the same table for larger models (ResNet-18, GPT-2, BERT, a LoRA Llama).

# %%
# NBVAL_CHECK_OUTPUT
by = {r["method"]: r for r in rows}
print("the clipped sums agree with the loop's (max |diff| < 1e-5):",
      all(by[m]["max_diff"] < 1e-5 for m in ("pv clipped_grad_sum", "pv, verify=False", "materialised + clip")))

# %% [markdown]
# ## 4 · The same step on LoRA adapters
#
# Full fine-tuning is what the clipped sum without (B, P) makes affordable; adapters need nothing else. `peft` adds
# a low-rank update B A (rank 8) next to the query and value projections of both blocks and freezes everything
# else, the classifier head trainable (`modules_to_save`); `pv.dp_step` sees the trainable parameters only and
# writes `.grad` on them alone.

# %%
# NBVAL_CHECK_OUTPUT
lora_model = hf_models.lora(copy.deepcopy(vit), ("q_proj", "v_proj"), rank=8, train_also=("classifier",))
trainable = {n: p for n, p in lora_model.named_parameters() if p.requires_grad}
print(f"{len(trainable)} trainable tensors, {sum(p.numel() for p in trainable.values()):,} numbers; "
      f"the model has {sum(p.numel() for p in lora_model.parameters()):,}")
lora_model.train()
pv.dp_step(lora_model, loss_fn, x[:50], labels[:50], C, noise_multiplier=SIGMA,
           generator=torch.Generator().manual_seed(2), expected_batch_size=50)
print(".grad on the adapters and the head only:",
      all((p.grad is not None) == p.requires_grad for p in lora_model.parameters()))

# %% [markdown]
# ## 5 · A padded batch of text: the per-sample loss of a causal LM
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
# The per-sample gradients of that loss, and the DP-SGD sum of the same batch. GPT-2 is causal: a token attends
# only to the tokens before it, so padding on the right changes nothing at the real tokens, and the gradient of
# the 7-token text equals its gradient run alone. The batch goes in as a tokenizer returns it, ids and attention
# mask in a dict (`model(**batch)`): with padding on the left, or a model that attends both ways (BERT), the mask
# is what keeps the padding out. `pv.clipped_grad_sum` takes the batch the same way and equals the per-sample
# gradients clipped and summed, without forming them.

# %%
# NBVAL_CHECK_OUTPUT
batch = {"input_ids": ids, "attention_mask": attention_mask}       # as a tokenizer gives it: model(**batch)
grads = pv.per_sample_grads(lm.model, pv.causal_lm_loss, batch, labels_lm, flat=True)  # (3, P)
short = pv.per_sample_grads(lm.model, pv.causal_lm_loss, ids[1:2, :7], labels_lm[1:2, :7], flat=True)
print(f"per-sample gradients {tuple(grads.shape)}; the padded text's == its gradient alone:",
      torch.allclose(grads[1], short[0], atol=1e-6))
summed = pv.clipped_grad_sum(lm.model, pv.causal_lm_loss, batch, labels_lm, 1.0)          # {name: (*shape)}
clipped = pv.dp_sgd_gradient(pv.per_sample_grads(lm.model, pv.causal_lm_loss, batch, labels_lm), 1.0, 0.0)
print("clipped_grad_sum == the per-sample gradients clipped and summed:",
      all(torch.allclose(summed[n], clipped[n], atol=1e-6) for n in clipped))
