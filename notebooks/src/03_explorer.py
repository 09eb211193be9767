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
# # 03 · The explorer
#
# Pick a **model** from the menu: the tutorial `MLP(784, hidden, 10)`, a small CNN, a transformer encoder, an
# LSTM classifier (these two read each image as 16 tokens: every 7x7 patch one token, its mean brightness in
# 16 levels; a deliberately simple tokenizer) or, where `transformers` and `peft` are installed, a tiny Hugging
# Face ViT with LoRA adapters (notebook 06's, only the adapters and the head trained). Move the sliders: **batch
# size** and the model's **width** (hidden units, channels, d_model, the LSTM's hidden size or the LoRA rank: the
# line next to the slider says which), the quantity
# (per-sample gradients or output Jacobian) and the strategies to compare. Within a moment you see the per-sample
# gradients at the new setting (a heatmap split by layer; the chosen sample as an image or as its tokens, with its
# first layer's gradients) and whether they agree with the loop (the definition: each sample's gradient computed
# alone); then each strategy's timing as it is measured (the bar chart grows; every strategy's result is checked
# against the loop too), and how it scales with the batch size. Below: **how the fast rule works** on the model's
# first layer with a closed-form rule (a Linear layer: g a^T; a convolution: the unfolded patches; an embedding:
# the rows of the used tokens), **the DP-SGD view** per layer, with a slider for the clipping threshold, and a
# table of which layer runs on which rule (or on the per-layer fallback).
#
# Timings are measured in interleaved rounds on this machine, with their spread. Where the first rounds vary,
# the numbers are shown as *provisional* while more rounds are timed; only a spread that stays large is flagged
# as noisy. Slow baselines are skipped above a limit you can raise ("time slow methods up to"), and the
# explorer says so. Run it in JupyterLab (`make lab`) or as a dashboard with Voila (the command is in the
# README).

# %%
from IPython.display import display
from torch import nn

import pergrad_viz as pv
from pergrad_viz.tutorial.data import CLASS_NAMES, load_sample

explorer = pv.widgets.explorer()
display(explorer)

# %% tags=["snapshot"]
# Build time only (tools/nbbuild.py): this cell's pictures of the explorer replace the widget above in the committed
# notebook, so that it shows the explorer's last figures before it is run (and on GitHub).
explorer.snapshot()

# %% [markdown]
# ## Your own model
#
# `pv.widgets.explorer(model=net, loss_fn=loss_fn, data=(x, y))` shows the same panels for your network on your
# data (`data` may also be a Dataset or a DataLoader; inputs as `per_sample_grads` takes them: a tensor, a tuple,
# a dict). The batch-size slider runs over your first samples; the network is only looked at, never trained or
# changed. Here: a small network of our own, a convolution with a Linear head, on 64 bundled images.

# %%
my_net = nn.Sequential(nn.Conv2d(1, 4, kernel_size=5, stride=3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 10))
images, labels = load_sample(64, flatten=False)  # (64, 1, 28, 28), (64,)
mine = pv.widgets.explorer(model=my_net, loss_fn=nn.CrossEntropyLoss(reduction="sum"), data=(images, labels),
                           class_names=CLASS_NAMES["fashion-mnist"], default_batch=16, sweep_batches=2)
display(mine)

# %% tags=["snapshot"]
# Build time only: pictures of the explorer on our own model replace its widget in the committed notebook.
mine.snapshot()
