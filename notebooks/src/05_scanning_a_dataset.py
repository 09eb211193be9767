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
# # 05 · Scanning a whole dataset
#
# Per-sample gradients pay off on whole datasets: to find mislabelled examples, to prune data (GraNd and EL2N
# scores, "Deep Learning on a Data Diet", 2021) and to attribute predictions to training examples (TracIn, TRAK,
# LoGra: dot products of projected per-sample gradients). `pv.scan` walks a dataset once and writes, per example
# and in dataset order:
#
# | quantity | shape | what |
# |---|---|---|
# | `loss` | (N,) | the example's loss |
# | `grad_norm` | (N,) | the norm of its loss gradient (ghost norms: the (N, P) gradients are never built) |
# | `layer_norms` | (N, L) | the same, per layer |
# | `el2n` | (N,) | the norm of softmax(logits) - onehot(label) |
# | `projection` | (N, K) | a seeded random projection of its gradient, K = `proj_dim` columns |
#
# to a directory of memory-mapped `.npy` files with a JSON manifest; it resumes where it stopped and runs on
# several processes under `torchrun` (see the end). Here: the `SmallCNN` on the 1,000 training images bundled with
# the package, 10% of their labels flipped.

# %%
# NBVAL_CHECK_OUTPUT
# %matplotlib inline
import tempfile
from pathlib import Path

import torch
from matplotlib.figure import Figure
from torch import nn

import pergrad_viz as pv
from pergrad_viz import viz
from pergrad_viz.tutorial.data import CLASS_NAMES
from pergrad_viz.tutorial.fashion_mnist import fashion_mnist
from pergrad_viz.tutorial.label_noise import flip_labels, precision_at_k, random_precision, train
from pergrad_viz.tutorial.networks import SmallCNN

torch.set_num_threads(1)                  # a tiny CNN: more threads only add overhead on a small machine
names = CLASS_NAMES["fashion-mnist"]
x, labels = fashion_mnist("train", source=None).tensors     # the bundled sample: (1000, 1, 28, 28), (1000,)
x_test, y_test = fashion_mnist("test", source=None).tensors
noisy, flipped = flip_labels(labels, 0.10, n_classes=10, seed=0)
print(f"{int(flipped.sum())} of {len(labels)} training labels flipped to another class")


# %%
def accuracy(model, inputs, targets):
    with torch.no_grad():
        return (model(inputs).argmax(1) == targets).float().mean().item()


torch.manual_seed(0)
model = SmallCNN()
history = train(model, x, noisy, epochs=30, lr=0.1, seed=0)      # SGD on the noisy labels; leaves model.eval()
print(f"training loss {history[0]:.2f} -> {history[-1]:.2f}; test accuracy {accuracy(model, x_test, y_test):.1%}")

# %% [markdown]
# ## 1 · The scan
#
# One call. The dataset is any map-style `Dataset` yielding `(input, label)`; here a `TensorDataset` with the
# noisy labels. The result maps each quantity to a tensor memory-mapped from `out`; `pv.load_scan(out)` gives
# the same later (or in another process).

# %%
workdir = tempfile.TemporaryDirectory()
train_scan = pv.scan(model, nn.CrossEntropyLoss(), torch.utils.data.TensorDataset(x, noisy),
                     quantities=("loss", "grad_norm", "layer_norms", "el2n"), proj_dim=256,
                     out=Path(workdir.name) / "train", progress=False)
for quantity, values in train_scan.items():
    print(f"{quantity:12s} {tuple(values.shape)}")
print("layers:", train_scan.layers)

# %% [markdown]
# ## 2 · Which examples are mislabelled?
#
# Rank the examples by each score and count the flipped labels among the top k (a random ranking catches 10%).

# %%
scores = {"loss": train_scan["loss"], "gradient norm": train_scan["grad_norm"], "EL2N": train_scan["el2n"]}
print("precision at k    " + "".join(f"{f'k={k}':>8s}" for k in (50, 100, 200)))
for name, s in scores.items():
    print(f"{name:18s}" + "".join(f"{precision_at_k(s, flipped, k):8.2f}" for k in (50, 100, 200)))
print(f"{'random ranking':18s}" + f"{random_precision(flipped):8.2f}" * 3)

# %%
# NBVAL_CHECK_OUTPUT
print("every score finds at least 3x more flipped labels in its top 100 than a random ranking:",
      all(precision_at_k(s, flipped, 100) >= 3 * random_precision(flipped) for s in scores.values()))

# %% [markdown]
# The examples with the largest gradient norms, with the label the data gave and the model's prediction:

# %%
top = torch.topk(train_scan["grad_norm"], 16).indices
predicted = model(x[top]).argmax(1)
titles = [f"{'FLIPPED ' if flipped[i] else ''}given {names[noisy[i]]}\npred. {names[p]}"
          for i, p in zip(top, predicted, strict=True)]
viz.image_grid(x[top], titles=titles, suptitle="largest per-sample gradient norms")

# %% [markdown]
# Per layer (`layer_norms`): the flipped examples pull every layer harder than the clean ones.

# %%
layer_norms = train_scan["layer_norms"]                                   # (1000, 4)
print(f"{'layer':8s}{'median norm, flipped':>22s}{'clean':>8s}")
for j, layer in enumerate(train_scan.layers):
    print(f"{layer:8s}{layer_norms[flipped, j].median():22.3f}{layer_norms[~flipped, j].median():8.3f}")

# %% [markdown]
# ## 3 · Pruning the data by score
#
# Keep half of the training set and train again from the same initialisation: the half with the lowest EL2N
# (the examples the model finds easy), the half with the highest (the hardest, as "Data Diet" keeps on clean
# data), or a random half. With noisy labels the hardest examples are largely the mislabelled ones.

# %%
half = len(x) // 2
order = torch.argsort(train_scan["el2n"])
subsets = {
    "all 1,000": torch.arange(len(x)),
    "lowest EL2N half": order[:half],
    "random half": torch.randperm(len(x), generator=torch.Generator().manual_seed(1))[:half],
    "highest EL2N half": order[half:],
}
pruned = {}
for name, keep in subsets.items():
    torch.manual_seed(0)
    m = SmallCNN()
    train(m, x[keep], noisy[keep], epochs=30, lr=0.1, seed=0)
    pruned[name] = accuracy(m, x_test, y_test)
    print(f"{name:18s} flipped labels kept: {int(flipped[keep].sum()):3d}   test accuracy: {pruned[name]:.1%}")



def accuracy_bars(accuracies: dict[str, float]) -> Figure:
    fig = Figure(figsize=(6, 2.2), layout="constrained")
    ax = fig.subplots()
    ax.barh(list(accuracies)[::-1], list(accuracies.values())[::-1], color="tab:blue")
    ax.set_xlabel("test accuracy")
    ax.set_xlim(0, 1)
    return fig


accuracy_bars(pruned)

# %%
# NBVAL_CHECK_OUTPUT
print("the lowest-EL2N half keeps under 10% of the flipped labels:",
      int(flipped[subsets["lowest EL2N half"]].sum()) < 10)
print("the highest-EL2N half trains a worse model than a random half:",
      pruned["highest EL2N half"] < pruned["random half"])

# %% [markdown]
# On 1,000 images the easy half does about as well as a random half of the same size; the hard half, holding
# nearly every flipped label, does far worse: scores that rank hard examples first are a data-cleaning tool
# before they are a pruning one.

# %% [markdown]
# ## 4 · Which training images drive a test prediction? (TracIn-style)
#
# The dot product of a test example's loss gradient with a training example's says how a gradient step on the
# training example changes the test loss. The projected gradients keep these dot products (in expectation) in
# K = 256 numbers per example instead of P: for a Linear layer the projection multiplies a projection of the
# layer's input by one of its output gradient (as LoGra does), so the (out, in) gradient is never formed. Scanning
# the test images with the same `proj_dim` and `seed` draws the same projection.

# %%
test_ids = torch.tensor([0, 1, 2, 3])
test_scan = pv.scan(model, nn.CrossEntropyLoss(), torch.utils.data.TensorDataset(x_test[test_ids], y_test[test_ids]),
                    quantities=("loss",), proj_dim=256, out=Path(workdir.name) / "test", progress=False)
influence = test_scan["projection"] @ train_scan["projection"].T            # (4, 1000)
cosine = influence / test_scan["projection"].norm(dim=1, keepdim=True) / train_scan["projection"].norm(dim=1)
by_dot, by_cosine = influence.topk(3, dim=1).indices, cosine.topk(3, dim=1).indices     # (4, 3) each
images, titles = [], []
for row, i in enumerate(test_ids):
    images.append(x_test[i])
    titles.append(f"TEST: {names[y_test[i]]}")
    for how, picked in (("dot", by_dot[row]), ("cos", by_cosine[row])):
        for j in picked:
            images.append(x[j])
            titles.append(f"{how}: {'FLIPPED ' if flipped[j] else ''}{names[noisy[j]]}")
viz.image_grid(torch.stack(images), titles=titles, ncols=7,
                 suptitle="each test image, then the 3 training images with the largest projected-gradient dot "
                          "product, then the 3 most similar by cosine")

# %% [markdown]
# The raw dot product favours training examples with large gradients, and those are often mislabelled: an image
# of a boot labelled "Trouser" pushes hard towards "Trouser" for every input, so it "supports" every trouser
# prediction (a known trait of TracIn-style scores). Normalised to a cosine, the score finds look-alikes instead.

# %%
# NBVAL_CHECK_OUTPUT
exact = (pv.per_sample_grads(model, nn.CrossEntropyLoss(), x_test[test_ids], y_test[test_ids], flat=True)
         @ pv.per_sample_grads(model, nn.CrossEntropyLoss(), x, noisy, flat=True).T)     # (4, 1000), exact
corr = torch.corrcoef(torch.stack([influence.flatten(), exact.flatten()]))[0, 1].item()
print("projected dot products correlate with the exact ones (> 0.9):", corr > 0.9)

# %% [markdown]
# ## 5 · At scale
#
# The same scan from the command line, on the full Fashion-MNIST (60,000 training images, from Debian's
# `dataset-fashion-mnist`, which `make data` installs; without it the bundled sample, with a note), resumable:
# a rerun with the same `--out` skips finished chunks, and a rerun with another model or settings is refused.
# `--checkpoint` takes the weights you trained, saved with `torch.save(model.state_dict(), "cnn.pt")` (without it, the
# seeded, untrained CNN).
#
# ```bash
# .venv/bin/python -m pergrad_viz scan --data fashion-mnist --model cnn --checkpoint cnn.pt \
#     --quantities loss,grad_norm,layer_norms,el2n --proj-dim 256 --out scans/train
# .venv/bin/torchrun --nproc_per_node 2 -m pergrad_viz scan --data fashion-mnist --model cnn --checkpoint cnn.pt \
#     --quantities loss,grad_norm,layer_norms,el2n --proj-dim 256 --out scans/train
# ```
#
# Each process scans its own chunks and writes its rows into the shared files; the result is one table in
# dataset order, identical to one process's. docs/scan.md gives the measured times.

# %%
workdir.cleanup()
