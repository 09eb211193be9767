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
# # 01 · One gradient per example
#
# The question people ask again and again: *"I have a batch of B examples. How do I get the gradient of the
# loss **for every example**, without a Python loop?"* The answer has shape **(B, P)**: one row per example, one
# column per trainable parameter.
#
# We use the classic setting of that question: a bias-free `2 -> 16 -> 2` network, `MSELoss(reduction='sum')`
# and 10 samples. "The gradient of sample *i*" means the gradient of `loss_fn(model(x[i:i+1]), y[i:i+1])`,
# exactly what a naive loop computes.

# %%
# NBVAL_CHECK_OUTPUT
# %matplotlib inline
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz import bench, viz
from pergrad_viz.tutorial.networks import bias_free_net

torch.manual_seed(0)
model = bias_free_net()                      # Linear(2, 16, bias=False) -> ReLU -> Linear(16, 2, bias=False)
loss_fn = nn.MSELoss(reduction="sum")
x = torch.randn(10, 2)                       # (B, 2)
y = torch.randn(10, 2)                       # (B, 2)
for name, p in model.named_parameters():
    print(f"{name:10s} {tuple(p.shape)}")
print("P =", sum(p.numel() for p in model.parameters()), "trainable scalars")

# %% [markdown]
# ## The error people hit
#
# The first idea is to wrap the usual `torch.autograd.grad` in `torch.func.vmap`, so that it runs "once per
# sample". It fails; here is the error it raises (its message only: the traceback runs for screens through
# PyTorch's internals and says nothing more):

# %%
# NBVAL_CHECK_OUTPUT
def grad_of_one(x_i, y_i):
    loss = loss_fn(model(x_i.unsqueeze(0)), y_i.unsqueeze(0))
    return torch.autograd.grad(loss, list(model.parameters()))


try:
    torch.func.vmap(grad_of_one)(x, y)
except RuntimeError as error:
    print(f"{type(error).__name__}: {error}")

# %% [markdown]
# **Why.** Inside `vmap`, every tensor is a *batched* wrapper that pretends to be one sample; the ordinary
# autograd graph is recorded on the real (whole-batch) tensors underneath, not on the per-sample wrappers.
# So the per-sample `loss` that `torch.autograd.grad` receives carries no `grad_fn` at vmap's level, and it
# refuses: *element 0 of tensors does not require grad*. `torch.autograd.grad` is not a transform `vmap` can
# batch; `torch.func.grad` is. It needs the parameters as explicit function inputs, which
# `torch.func.functional_call` provides.
#
# ## The fix with `torch.func`

# %%
# NBVAL_CHECK_OUTPUT
params = {name: p.detach() for name, p in model.named_parameters()}


def loss_of_one(params, x_i, y_i):
    output = torch.func.functional_call(model, params, (x_i.unsqueeze(0),))   # a batch of one, as in the loop
    return loss_fn(output, y_i.unsqueeze(0))


per_sample = torch.func.vmap(torch.func.grad(loss_of_one), in_dims=(None, 0, 0))(params, x, y)
for name, g in per_sample.items():
    print(f"{name:10s} {tuple(g.shape)}")                            # (B, *param.shape)

# %% [markdown]
# ## The naive loop, and one backward per sample
#
# The loop is the definition. `autograd_stack` runs the forward pass once for the whole batch and then one
# `torch.autograd.grad` per sample's loss (`retain_graph=True`): samples do not interact, so each gives
# that sample's gradient.

# %%
# NBVAL_CHECK_OUTPUT
names, weights = zip(*model.named_parameters(), strict=True)

loop = {n: [] for n in names}
for i in range(len(x)):
    loss_i = loss_fn(model(x[i:i + 1]), y[i:i + 1])
    for n, g in zip(names, torch.autograd.grad(loss_i, weights), strict=True):
        loop[n].append(g)
loop = {n: torch.stack(gs) for n, gs in loop.items()}               # (B, *param.shape)

losses = ((model(x) - y) ** 2).sum(dim=1)                            # (B,): each sample's own loss
stacked = {n: [] for n in names}
for i in range(len(x)):
    for n, g in zip(names, torch.autograd.grad(losses[i], weights, retain_graph=True), strict=True):
        stacked[n].append(g)
stacked = {n: torch.stack(gs) for n, gs in stacked.items()}

print("torch.func == loop:      ", all(torch.allclose(per_sample[n], loop[n], atol=1e-6) for n in names))
print("autograd_stack == loop:  ", all(torch.allclose(stacked[n], loop[n], atol=1e-6) for n in names))

# %% [markdown]
# ## The same in one line, with every strategy
#
# `pv.per_sample_grads` does all of this for any model: it checks the inputs, leaves the model as it found it,
# and picks a strategy (`auto`: the `hooks` strategy where every layer has a rule, else `torch_func`).
# `flat=True` gives one (B, P) tensor.

# %%
# NBVAL_CHECK_OUTPUT
reference = torch.cat([loop[n].flatten(1) for n in names], dim=1)   # our own loop above, as one (B, P) tensor
print("result:", tuple(reference.shape), "(B, P)")
for strategy in pv.STRATEGIES:
    g = pv.per_sample_grads(model, loss_fn, x, y, strategy=strategy, flat=True)
    same = [torch.allclose(g[i], reference[i], atol=1e-6) for i in range(len(x))]   # sample by sample
    print(f"{strategy:15s} agrees with our loop on {sum(same)} of {len(x)} samples")
print("auto picks:", pv.resolve_strategy("auto", model))

# %% [markdown]
# (Each row is compared with the same sample's row of the loop: a result with its rows in another order would
# fail, where a comparison of sums over the batch would not.)
#
# What do they look like? Each row is one sample's gradient, each column one of the P = 64 parameters; the
# vertical line separates the two layers' weights. Red and blue are the sign. Rows differ a lot: each sample
# pulls the weights its own way, and the batch gradient is their sum.

# %%
viz.gradient_heatmap(reference, viz.param_boundaries(model), ylabel="sample i", min_layer_frac=0,
                       title="the 10 per-sample gradients: B = 10 rows x P = 64 parameters")

# %% [markdown]
# How fast is each one here? A tiny model and batch, so the fixed costs of each strategy dominate; the
# notebook `02_output_jacobians` and `python -m pergrad_viz bench` show how this changes with size.
# (Timings are measured now, on this machine; "vs loop" is the speed-up over the loop, from the same run. A row
# marked NOISY spread by more than a quarter of its median over the rounds, the machine busy with something else:
# rerun the cell, or read that row's ratio loosely.)

# %%
records = bench.compare(model, loss_fn, x, y, quantity="grads", min_run_time=0.1)
print(bench.format_table(records))
viz.bar_figure(records, title="per-sample gradients of the 2-16-2 network, B = 10 (measured now)")

# %% [markdown]
# ## `reduction='sum'` or `'mean'`: what "the gradient of one sample" means
#
# With `reduction='sum'`, the batch loss is the sum of the samples' losses, so the per-sample gradients **add up
# to the ordinary batch gradient**. With `reduction='mean'`, the loss of one sample is a mean over *its own*
# elements (here 2 outputs), and the batch loss divides by B x 2: the per-sample gradients are then half of the
# 'sum' ones, and they add up to B times the batch gradient. Neither is wrong; pick the one whose scale you want
# (DP-SGD clipping, for instance, needs to know which one it is clipping).

# %%
# NBVAL_CHECK_OUTPUT
g_sum = pv.per_sample_grads(model, nn.MSELoss(reduction="sum"), x, y, flat=True)
g_mean = pv.per_sample_grads(model, nn.MSELoss(reduction="mean"), x, y, flat=True)
mean_loop = torch.stack([torch.cat([g.flatten() for g in torch.autograd.grad(
    nn.MSELoss(reduction="mean")(model(x[i:i + 1]), y[i:i + 1]), weights)]) for i in range(len(x))])  # (B, P)

sum_loss = nn.MSELoss(reduction="sum")(model(x), y)
batch_sum = torch.cat([g.flatten() for g in torch.autograd.grad(sum_loss, weights)])
batch_mean = torch.cat([g.flatten() for g in torch.autograd.grad(nn.MSELoss()(model(x), y), weights)])

print("'sum' per-sample == our loop, sample by sample: ", torch.allclose(g_sum, reference, atol=1e-6))
print("'mean' per-sample == its own loop, sample by sample:", torch.allclose(g_mean, mean_loop, atol=1e-6))
print("'mean' per-sample == 'sum' per-sample / 2:     ", torch.allclose(g_mean, g_sum / 2, atol=1e-6))
print("'sum':  per-sample grads add up to batch grad:  ", torch.allclose(g_sum.sum(0), batch_sum, atol=1e-5))
print("'mean': per-sample grads add up to B x batch grad:",
      torch.allclose(g_mean.sum(0), len(x) * batch_mean, atol=1e-5))
