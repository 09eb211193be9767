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
# Move the sliders: **batch size** and **hidden width** of the tutorial `MLP(784, hidden, 10)`, the quantity
# (per-sample gradients or output Jacobian) and the strategies to compare. Within a moment you see the per-sample
# gradients at the new setting (a heatmap, one sample's first-layer gradients as images) and whether they agree
# with the loop (the definition: each sample's gradient computed alone); then each strategy's timing as it is
# measured (the bar chart grows; every strategy's result is checked against the loop too), and how it scales
# with the batch size. Below: **how the fast rule works** for one sample, and **the DP-SGD view**, with a slider
# for the clipping threshold.
#
# Timings are measured in interleaved rounds on this machine, with their spread. Where the first rounds vary,
# the numbers are shown as *provisional* while more rounds are timed; only a spread that stays large is flagged
# as noisy. Slow baselines are skipped above a limit you can raise ("time slow methods up to"), and the
# explorer says so. Run it in JupyterLab (`make lab`) or as a dashboard with Voila (the command is in the
# README).

# %%
from IPython.display import display

import pergrad_viz as pv

explorer = pv.widgets.explorer()
display(explorer)

# %% tags=["snapshot"]
# Build time only (tools/nbbuild.py): this cell's pictures of the explorer replace the widget above in the committed
# notebook, so that it shows the explorer's last figures before it is run (and on GitHub).
explorer.snapshot()
