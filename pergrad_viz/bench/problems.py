"""Real architectures for ``python -m pergrad_viz bench --model NAME``: seeded, built locally (no downloads).

Every problem is ``(model, loss_fn, inputs (B, ...), targets (B,))`` with ``CrossEntropyLoss(reduction='sum')``
over 10 classes (so that Opacus' and BackPACK's per-sample gradients are the plain per-sample gradients):

* ``mlp``: the tutorial's ``MLP(784, 20, 10)`` on (B, 784) bundled Fashion-MNIST images (those of
  :func:`setting`, the sweeps' problem: the same MLP with MSE on one-hot labels);
* ``resnet18``: torchvision's ResNet-18 in eval mode (BatchNorm on its running statistics), (B, 3, 32, 32);
* ``mobilenet``: torchvision's MobileNetV3-Small in eval mode, (B, 3, 32, 32);
* ``transformer``: a 2-layer ``nn.TransformerEncoder`` (d_model 64, 4 heads, feed-forward 128, batch-first, eval)
  on (B, 16, 64) token features, mean over tokens, a Linear head;
* ``lstm``: a 2-layer batch-first ``nn.LSTM`` (32 -> 64) on (B, 16, 32), a Linear head on the last step.

and the models people fine-tune (:mod:`~pergrad_viz.tutorial.hf_models`:
hidden size 128, 2 layers, built from configs; they need
``transformers``, ``timm``, ``peft``), measured at B=16 (:data:`BATCH`), in training mode as when fine-tuning (every
dropout has p=0 and none has batch statistics, so it is the function of eval mode; Opacus records only in training):

* ``gpt2``, ``llama``, ``lora-llama`` (LoRA on the attention's q and v, only the adapters trainable): causal LMs on
  (B, 32) token ids (vocabulary 1,000), the labels the ids themselves, with
  ``causal_lm_loss(reduction='sum')`` (each sample's loss is the mean over its tokens);
* ``bert`` on (B, 32) token ids, ``hf-vit``, ``timm-vit``, ``convnext`` on (B, 3, 32, 32): cross-entropy over 10
  classes as above.

and, at B=32 as the first ones:

* ``scaleshift``, ``parent-param``, ``bilinear``: small models whose middle layer has no closed-form rule (the
  per-layer fallback): a custom ``x * w + b`` layer, a parameter used in the forward of a layer with a child, and
  ``nn.Bilinear`` (:class:`SmallFallbackNet`, on (B, 32) features).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from pergrad_viz.core.extras import require
from pergrad_viz.core.losses import causal_lm_loss
from pergrad_viz.tutorial import hf_models as zoo_hf
from pergrad_viz.tutorial.data import load_sample
from pergrad_viz.tutorial.networks import MLP, LSTMClassifier, TransformerClassifier

FINE_TUNED: tuple[str, ...] = tuple(zoo_hf.BUILDERS)
MODELS: tuple[str, ...] = ("mlp", "resnet18", "mobilenet", "transformer", "lstm", *FINE_TUNED)
CLASSES = 10
BATCH: dict[str, int] = dict.fromkeys(FINE_TUNED, 16)
"""The batch size ``bench --model NAME`` uses without ``--batch-sizes`` where it is not 32."""


def setting(batch: int, hidden: int, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
            seed: int = 0) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """The benchmark problem: (MLP(784, hidden, 10), MSE reduction='sum', X (B, 784), one-hot Y (B, 10)).

    Images are the first ``batch`` of the bundled training sample (repeated if more are asked for).
    """
    torch.manual_seed(seed)
    model = MLP(784, hidden, 10).to(device=device, dtype=dtype)
    x, labels = load_sample(min(batch, 1000), train=True)
    reps = -(-batch // x.shape[0])
    x, labels = x.repeat(reps, 1)[:batch], labels.repeat(reps)[:batch]
    y = nn.functional.one_hot(labels, 10).to(dtype)
    return model, nn.MSELoss(reduction="sum"), x.to(device, dtype), y.to(device)


def problem(name: str, batch: int, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
            seed: int = 0) -> tuple[nn.Module, Callable, torch.Tensor, torch.Tensor]:
    """The benchmark problem ``name`` at batch size ``batch``: (model, loss_fn, inputs, targets)."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; valid: {', '.join(MODELS)}")
    if name in FINE_TUNED:
        return _fine_tuned(name, batch, device=device, dtype=dtype, seed=seed)
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    if name == "mlp":
        model, _, x, _ = setting(batch, 20, device=device, dtype=dtype, seed=seed)
        y = torch.randint(0, CLASSES, (batch,), generator=generator)
    else:
        if name in ("resnet18", "mobilenet"):
            torchvision = require("torchvision", f"the benchmark model {name!r}", extra="bench")
            build = torchvision.models.resnet18 if name == "resnet18" else torchvision.models.mobilenet_v3_small
            model = build(num_classes=CLASSES)
            x = torch.randn(batch, 3, 32, 32, generator=generator)
        elif name in FALLBACK_MODELS:
            model = SmallFallbackNet(name)
            x = torch.randn(batch, 32, generator=generator)
        elif name == "transformer":
            model = TransformerClassifier()
            x = torch.randn(batch, 16, 64, generator=generator)
        else:
            model = LSTMClassifier()
            x = torch.randn(batch, 16, 32, generator=generator)
        model.eval()
        y = torch.randint(0, CLASSES, (batch,), generator=generator)
    model = model.to(device=device, dtype=dtype)
    return model, nn.CrossEntropyLoss(reduction="sum"), x.to(device=device, dtype=dtype), y.to(device)


def _fine_tuned(name: str, batch: int, *, device: str | torch.device, dtype: torch.dtype, seed: int
                ) -> tuple[nn.Module, object, torch.Tensor, torch.Tensor]:
    """A :mod:`~pergrad_viz.tutorial.hf_models` model
    in training mode with its batch: ids (B, 32) int64 and labels (B, 32) (the ids)
    for a causal LM, ids (B, 32) or images (B, 3, 32, 32) of ``dtype`` and classes (B,) otherwise."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    model = zoo_hf.BUILDERS[name]().train().to(device=device, dtype=dtype)
    if name in zoo_hf.TEXT:
        x = torch.randint(0, zoo_hf.VOCAB, (batch, zoo_hf.TOKENS), generator=generator)
    else:
        x = torch.randn(batch, 3, zoo_hf.IMAGE, zoo_hf.IMAGE, generator=generator).to(dtype)
    if name in zoo_hf.CAUSAL_LM:
        return model, functools.partial(causal_lm_loss, reduction="sum"), x.to(device), x.clone().to(device)
    y = torch.randint(0, CLASSES, (batch,), generator=generator)
    return model, nn.CrossEntropyLoss(reduction="sum"), x.to(device), y.to(device)


def hand_written_vmap(model: nn.Module, loss_fn: nn.Module, inputs: torch.Tensor, targets: torch.Tensor
                      ) -> torch.Tensor:
    """The textbook ``vmap(grad(functional_call))``, written as a user would, concatenated to (B, P)."""
    from torch.func import functional_call, grad, vmap

    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def loss_of_one(p, x, y):
        return loss_fn(functional_call(model, (p, frozen, buffers), (x.unsqueeze(0),)), y.unsqueeze(0))

    grads = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(params, inputs, targets)
    return torch.cat([g.reshape(inputs.shape[0], -1) for g in grads.values()], dim=1)


# --- small models with layers on the per-layer fallback (no closed-form rule): `bench --model scaleshift` etc. --------

class ScaleShift(nn.Module):
    """``x * weight + bias`` per feature: a custom layer with its own parameters and no rule."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features))
        self.bias = nn.Parameter(torch.linspace(-0.1, 0.1, features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


class GatedResidual(nn.Module):
    """``x + gate * tanh(fc(x))``: a parameter (``gate``) used in the forward of the layer that holds a child."""

    def __init__(self, features: int):
        super().__init__()
        self.fc = nn.Linear(features, features)
        self.gate = nn.Parameter(torch.full((features,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.gate * torch.tanh(self.fc(x))


class SmallFallbackNet(nn.Module):
    """(B, 32) -> Linear(32, 64) -> ``kind`` -> tanh -> Linear(64, classes): ``kind`` is ``scaleshift``
    (:class:`ScaleShift`), ``parent-param`` (:class:`GatedResidual`) or ``bilinear`` (two Linear(32, 64) branches
    into ``nn.Bilinear(64, 64, 64)``)."""

    def __init__(self, kind: str, features: int = 32, hidden: int = 64, classes: int = CLASSES):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(features, hidden)
        if kind == "scaleshift":
            self.mid = ScaleShift(hidden)
        elif kind == "parent-param":
            self.mid = GatedResidual(hidden)
        else:
            self.other = nn.Linear(features, hidden)
            self.mid = nn.Bilinear(hidden, hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = self.mid(h, torch.tanh(self.other(x))) if self.kind == "bilinear" else self.mid(h)
        return self.head(torch.tanh(h))


FALLBACK_MODELS: tuple[str, ...] = ("scaleshift", "parent-param", "bilinear")
MODELS = (*MODELS, *FALLBACK_MODELS)


def hand_written_jacrev(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The textbook ``vmap(jacrev(functional_call))`` per-sample Jacobian, written as a user would: (B, Y, P)."""
    from torch.func import functional_call, jacrev, vmap

    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    buffers = dict(model.named_buffers())

    def output_of_one(p, x):
        return functional_call(model, (p, frozen, buffers), (x.unsqueeze(0),)).reshape(-1)

    jac = vmap(jacrev(output_of_one), in_dims=(None, 0))(params, inputs)
    batch, outputs = inputs.shape[0], next(iter(jac.values())).shape[1]
    return torch.cat([j.reshape(batch, outputs, -1) for j in jac.values()], dim=2)
