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
# # 04 · What per-sample gradients are for
#
# Four things one gradient per example buys you, each a few lines on top of `pergrad_viz`:
#
# 1. **finding mislabelled examples** by the size of their gradient;
# 2. **per-sample clipping**, the heart of differentially private SGD;
# 3. **gradient similarity**: which examples pull the model the same way;
# 4. the **empirical neural tangent kernel**, K(x, x') = J(x) J(x')^T.
#
# All on the tutorial `MLP(784, 20, 10)` and the Fashion-MNIST sample bundled with the package.

# %% [markdown]
# ## 1 · Finding mislabelled examples
#
# We flip the labels of a known 5% of the 1,000 training images (seeded), train briefly, and rank the samples by
# the norm of their loss gradient: the model is pulled hardest by the examples it cannot fit, and a wrong label
# is a prime reason not to fit. `pv.per_sample_grad_norms` computes the (B,) norms without ever building the
# (B, P) gradients (for Linear layers, ||g_i (x) a_i|| = ||g_i|| ||a_i||).

# %%
# NBVAL_CHECK_OUTPUT
# %matplotlib inline
import torch
from torch import nn

import pergrad_viz as pv
from pergrad_viz import viz
from pergrad_viz.tutorial.data import CLASS_NAMES, load_sample
from pergrad_viz.tutorial.label_noise import flip_labels, precision_at_k, random_precision, train
from pergrad_viz.tutorial.networks import MLP

names = CLASS_NAMES["fashion-mnist"]
x, labels = load_sample(1000)                                   # (1000, 784), (1000,)
noisy, flipped = flip_labels(labels, 0.05, n_classes=10, seed=0)
print(f"{int(flipped.sum())} of {len(labels)} labels flipped, each to another class:",
      bool((noisy[flipped] != labels[flipped]).all()))

# %%
torch.manual_seed(0)
model = MLP(784, 20, 10)
history = train(model, x, noisy, epochs=10, seed=0)           # plain SGD on the noisy labels
print("training loss per epoch:", [round(h, 3) for h in history])

# %%
loss_fn = nn.CrossEntropyLoss(reduction="sum")
norms = pv.per_sample_grad_norms(model, loss_fn, x, noisy)     # (1000,)
k = int(flipped.sum())
for kk in (10, 25, k, 2 * k):
    print(f"precision at k={kk:3d}: {precision_at_k(norms, flipped, kk):.2f}   "
          f"(random ranking: {random_precision(flipped):.2f})")

# %%
# NBVAL_CHECK_OUTPUT
print(f"precision at k={k} is at least 3x that of a random ranking:",
      precision_at_k(norms, flipped, k) >= 3 * random_precision(flipped))

# %% [markdown]
# The top of the ranking, with the label the data gave and the one the model predicts (flipped ones are marked):

# %%
top = torch.topk(norms, 16).indices
predicted = model(x[top]).argmax(1)
titles = [f"{'FLIPPED ' if flipped[i] else ''}given {names[noisy[i]]}\npred. {names[p]}"
          for i, p in zip(top, predicted, strict=True)]
viz.image_grid(x[top], titles=titles, suptitle="largest per-sample gradient norms")

# %% [markdown]
# The loss itself ranks the flipped labels too (notebook 05 scores both on the same kind of data; the two are
# related: for cross-entropy the gradient with respect to the logits is p - onehot); the gradient norm also weighs
# how strongly the example's *input* drives the parameters.
#
# ### How the norms come without the gradients: the fast rule
#
# For a Linear layer, the gradient of sample i's loss with respect to the weight is an outer product: the
# backprop signal g_i at the layer's output (one number per hidden unit) times the layer's input a_i (here the
# image). One backward pass for the whole batch gives every g_i; the norm of the outer product is
# ||g_i|| ||a_i||, two small norms instead of a 20 x 784 matrix. For the sample at the top of the ranking:

# %%
i = int(top[0])
h = model.fc1(x[i:i + 1]).detach().requires_grad_(True)                 # fc1's output for sample i: (1, 20)
(g_i,) = torch.autograd.grad(loss_fn(model.fc2(model.act(h)), noisy[i:i + 1]), h)   # the backprop signal
w_grad = pv.per_sample_grads(model, loss_fn, x[i:i + 1], noisy[i:i + 1])["fc1.weight"][0]   # (20, 784)
print("g_i a_i^T == the per-sample gradient of fc1.weight:", torch.allclose(torch.outer(g_i[0], x[i]), w_grad,
                                                                          atol=1e-6))
viz.outer_product_figure(x[i], g_i[0], gradient_norm=float(w_grad.norm()),
                           title=f"sample {i} (given {names[noisy[i]]}): fc1.weight's gradient is g_i a_i^T")

# %% [markdown]
# ## 2 · Per-sample clipping: the heart of DP-SGD
#
# DP-SGD bounds each example's influence: clip every per-sample gradient to norm C, sum, add Gaussian noise of
# standard deviation sigma C. With per-sample gradients in hand that is three lines; `pv.clip_per_sample` and
# `pv.dp_sgd_gradient` are those lines.

# %%
# NBVAL_CHECK_OUTPUT
xb, yb = x[:256], noisy[:256]
grads = pv.per_sample_grads(model, loss_fn, xb, yb, flat=True)         # (256, P)
C = 1.0
clipped, before = pv.clip_per_sample(grads, max_norm=C)
after = clipped.norm(dim=1)
print(f"per-sample gradients {tuple(grads.shape)}; clipped norms all <= C: {bool((after <= C * (1 + 1e-5)).all())}")
print("samples already within C are unchanged:", torch.equal(clipped[before <= C], grads[before <= C]))

# %%
# NBVAL_CHECK_OUTPUT
batch_loss = loss_fn(model(xb), yb)
batch_grad = torch.cat([g.flatten() for g in torch.autograd.grad(batch_loss, list(model.parameters()))])
print("sum of per-sample gradients == ordinary batch gradient:", torch.allclose(grads.sum(0), batch_grad, atol=1e-4))

# %%
generator = torch.Generator().manual_seed(0)
noisy_sum = pv.dp_sgd_gradient(grads, max_norm=C, noise_multiplier=1.0, generator=generator)
cosine = nn.functional.cosine_similarity
print(f"cosine(batch gradient, clipped sum) = {cosine(batch_grad, clipped.sum(0), dim=0):.2f}, "
      f"cosine(batch gradient, clipped sum + noise) = {cosine(batch_grad, noisy_sum, dim=0):.2f}")

# %% [markdown]
# Before and after: the bins are aligned to C, so the clipped norms (exactly C) sit in the bin that ends at the
# C line.

# %%
viz.norm_histogram(before, after, C)

# %% [markdown]
# Where does the norm come from, and how much does clipping change the sum? The same batch, per layer (weight and
# bias together; their squares add up to the total's), with the fraction clipped and the norms of the plain and
# the clipped sums. The explorer (notebook 03) has this view with a slider for C.

# %%
bounds = viz.param_boundaries(model)
layers = {layer: torch.cat([grads[:, a:b] for n, a, b in bounds if n.startswith(layer + ".")], dim=1).norm(dim=1)
          for layer in ("fc1", "fc2")}
viz.clipping_figure(before, layers, C, sums=(float(grads.sum(0).norm()), float(clipped.sum(0).norm())),
                      title=f"per-sample gradient norms of {len(xb)} training images, C = {C:g}")

# %% [markdown]
# ## 3 · Gradient similarity
#
# Cosine similarity between per-sample gradients, for 10 samples of each class sorted by class: blocks of high
# similarity on the diagonal are examples that pull the model the same way; off-diagonal negative blocks pull in
# opposite directions.

# %%
x_test, y_test = load_sample(1000, train=False)
order = torch.cat([torch.nonzero(y_test == c).flatten()[:10] for c in range(10)])   # 10 per class, sorted
G = pv.per_sample_grads(model, loss_fn, x_test[order], y_test[order], flat=True)
Gn = G / G.norm(dim=1, keepdim=True)
similarity = Gn @ Gn.T                                                               # (100, 100)
viz.grouped_heatmap(similarity, y_test[order], group_names=names,
                      title="cosine similarity of per-sample gradients")

# %%
# NBVAL_CHECK_OUTPUT
same = y_test[order].unsqueeze(0) == y_test[order].unsqueeze(1)
off_diagonal = ~torch.eye(len(order), dtype=torch.bool)
print("examples of the same class are more alike than of different classes:",
      similarity[same & off_diagonal].mean().item() > similarity[~same].mean().item())

# %% [markdown]
# ## 4 · The empirical neural tangent kernel
#
# K[i, j] = J(x_i) J(x_j)^T, a (Y, Y) block per pair of samples: how a gradient step on sample j moves the outputs
# on sample i. `pv.empirical_ntk` computes it from the layer rules without materialising the (N, Y, P)
# Jacobians where the model allows it (for a Linear layer, a_i . a_j times g_i g_j^T); `mode="trace"` sums the
# diagonal over outputs, giving an (N, N) matrix.

# %%
sel = torch.argsort(y_test[:32], stable=True)                                         # 32 samples, by class
x32 = x_test[sel]
K = pv.empirical_ntk(model, x32, mode="trace")                                         # (32, 32)
viz.grouped_heatmap(K, y_test[sel], group_names=names, symmetric=False,
                      title="empirical NTK, trace over outputs")

# %%
# NBVAL_CHECK_OUTPUT
J = pv.per_sample_jacobian(model, x32, flat=True)                 # (32, Y, P), materialised
K_full = pv.empirical_ntk(model, x32, mode="full")               # (32, 32, Y, Y)
print("full:", tuple(K_full.shape), " trace:", tuple(K.shape))


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


print("full == J J^T (float32, relative error < 1e-5):",
      relative_error(K_full, torch.einsum("iyp,jzp->ijyz", J, J)) < 1e-5)
print("trace == its diagonal summed (relative error < 1e-5):",
      relative_error(K, torch.einsum("iyp,jyp->ij", J, J)) < 1e-5)
