"""What the explorer knows about a network: a :class:`ModelSpec` (how to build it at a width, its inputs, what a
sample looks like, its first layer with a closed-form rule). The explorer's model works from a spec, never from a
network's constants.

The built-in menu (:data:`MENU`), all on the bundled Fashion-MNIST sample, with MSE ``reduction='sum'`` on one-hot
targets as in the tutorial:

* ``"mlp"``: the tutorial ``MLP(784, width, 10)`` on (B, 784) images (width = hidden units; the default);
* ``"cnn"``: :class:`pergrad_viz.tutorial.networks.SmallCNN` on (B, 1, 28, 28) images (width = conv1's channels);
* ``"transformer"``: :func:`pergrad_viz.tutorial.networks.token_transformer` (width = d_model) and
* ``"lstm"``: :func:`~pergrad_viz.tutorial.networks.token_lstm`
  (width = the LSTM's hidden size), both on (B, 16) token ids:
  each 7x7 patch of the image is one token, its mean brightness quantised to 16 levels
  (:func:`pergrad_viz.tutorial.networks.image_tokens`, kept simple on purpose: a sequence the learner can read);
* ``"vit-lora"``, where transformers and peft are installed:
  :func:`pergrad_viz.tutorial.hf_models.fashion_vit_lora`, notebook 06's tiny Hugging Face ViT (hidden 32) on
  (B, 1, 28, 28) images, with peft LoRA adapters on its query and value projections (width = the LoRA rank); only
  the adapters and the classifier head are trainable.

:func:`user_spec` describes a user's own network and data (``pv.widgets.explorer(model=net, loss_fn=..., data=...)``):
its width is fixed, its batch sizes are the first B samples of the data.

>>> spec = MENU["cnn"]
>>> model, loss_fn, x, y, labels = spec.problem(8, 4)     # SmallCNN(channels=4), x (8, 1, 28, 28), y (8, 10)
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from pergrad_viz.core.batch import Batch, cut
from pergrad_viz.tutorial.data import CLASS_NAMES, load_sample
from pergrad_viz.tutorial.networks import MLP, PATCH, VOCAB, SmallCNN, image_tokens, token_lstm, token_transformer

__all__ = ["MENU", "ModelSpec", "Problem", "user_spec"]

Problem = tuple[nn.Module, nn.Module, object, object, torch.Tensor]
"""(model, loss_fn, inputs (as per_sample_grads takes them, B first), targets, labels (B,) int64, -1 = none)."""

FASHION = CLASS_NAMES["fashion-mnist"]


@dataclass(frozen=True)
class ModelSpec:
    """A network the explorer can show.

    Attributes:
        key: the menu's key (``"mlp"``, ``"cnn"``, ..., ``"yours"``).
        title: the dropdown's text.
        width_name: the width slider's description (``"hidden width"``, ``"channels"``, ``"d_model"`` ...); empty
            where the width is fixed (a user's network).
        width_help: one sentence: what the width means for this network.
        widths, default_width: the width slider's options and start.
        default_batch: the batch size the explorer starts at.
        sample_kind: ``"image"`` (28x28; shown as an image), ``"tokens"`` (a (T,) sequence of ids, shown as a
            ``token_grid`` grid) or ``"other"`` (not drawn; the panel says so).
        first_layer: the module whose closed-form rule the "how the fast rule works" panel explains (a Linear,
            Conv2d or Embedding), or None.
        class_names: names of the labels (None: ``"class k"``).
        make: ``(batch, width) -> Problem``.
        imports: the slow libraries ``make`` imports (modules, in order): the explorer imports them ahead while it
            is idle (:mod:`.prefetch`), so that the network's first visit does not wait for them.
        output: which tensor of the network's output the Jacobian is of (``per_sample_jacobian``'s ``output=``,
            e.g. ``lambda out: out.logits``); None: the output itself.
    """

    key: str
    title: str
    width_name: str
    width_help: str
    widths: tuple[int, ...]
    default_width: int
    default_batch: int
    sample_kind: str
    first_layer: str | None
    class_names: tuple[str, ...] | None
    make: Callable[[int, int], Problem] = field(repr=False)
    token_grid: tuple[int, int] | None = None
    max_batch: int | None = None  # a user's data: at most this many samples
    imports: tuple[str, ...] = ()
    output: Callable[[object], torch.Tensor] | None = field(default=None, repr=False)

    def problem(self, batch: int, width: int) -> Problem:
        """The network at ``width`` (seeded: the same weights every time) and the first ``batch`` samples."""
        return self.make(batch, width)

    def describe(self, width: int) -> str:
        """How titles name the width: ``"hidden width 20"``, ``"small CNN, 8 channels"``, ``"your model"``."""
        return describe_width(self.key, width)

    @functools.cached_property
    def _sizes(self) -> dict[int, int]:
        return {}

    def num_params(self, width: int) -> int:
        """P, the trainable parameters at ``width`` (built once per width)."""
        if width not in self._sizes:
            model = self.make(1, width)[0]
            self._sizes[width] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return self._sizes[width]

    def label(self, k: int) -> str:
        if k < 0:
            return "no label"
        return self.class_names[k] if self.class_names is not None and k < len(self.class_names) else f"class {k}"


_WIDTHS = {"mlp": "hidden width {}", "cnn": "small CNN, {} channels", "transformer": "transformer, d_model {}",
           "lstm": "LSTM, hidden size {}", "vit-lora": "ViT with LoRA, rank {}"}


def describe_width(key: str, width: int) -> str:
    """The width as titles say it, for a spec's key (``"your model"`` for one without a width)."""
    return _WIDTHS[key].format(width) if key in _WIDTHS else "your model"


@functools.lru_cache(maxsize=4)
def _images(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, 784) normalised images and (B,) labels: the bundled training sample, repeated beyond 1,000."""
    x, labels = load_sample(min(batch, 1000), train=True)
    reps = -(-batch // x.shape[0])
    return x.repeat(reps, 1)[:batch], labels.repeat(reps)[:batch]


def _builtin(build: Callable[[int], nn.Module], encode: Callable[[torch.Tensor], torch.Tensor]
             ) -> Callable[[int, int], Problem]:
    def make(batch: int, width: int) -> Problem:
        with torch.random.fork_rng(devices=[]):  # seeded here, the user's global random state left as it was
            torch.manual_seed(0)
            model = build(width)
        x, labels = _images(batch)
        y = nn.functional.one_hot(labels, 10).float()
        return model, nn.MSELoss(reduction="sum"), encode(x), y, labels.clone()
    return make


def _mlp(width: int) -> nn.Module:
    return MLP(784, width, 10)


MENU: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", "tutorial MLP: 784 -> hidden -> 10", "hidden width",
                     "hidden width: the units of the MLP's one hidden layer (fc1's outputs)",
                     (8, 16, 20, 32, 64, 128, 256, 512), 20, 32, "image", "fc1", FASHION,
                     _builtin(_mlp, lambda x: x)),
    "cnn": ModelSpec("cnn", "small CNN: conv -> GroupNorm -> conv -> linear", "channels",
                     "channels: conv1's output channels (conv2 has twice as many)", (4, 8, 16, 32, 64), 8, 32,
                     "image", "conv1", FASHION,
                     _builtin(lambda c: SmallCNN(channels=c), lambda x: x.reshape(-1, 1, 28, 28))),
    "transformer": ModelSpec("transformer", "transformer encoder on 16 image tokens", "d_model",
                             "d_model: the width of the token embeddings and of the encoder layer (4 heads)",
                             (8, 16, 32, 64, 128), 32, 32, "tokens", "embed", FASHION,
                             _builtin(token_transformer, image_tokens), token_grid=(28 // PATCH, 28 // PATCH)),
    "lstm": ModelSpec("lstm", "LSTM classifier on 16 image tokens", "hidden size",
                      "hidden size: the LSTM's state width (its four gates are 4x that)", (8, 16, 32, 64, 128), 32,
                      32, "tokens", "embed", FASHION, _builtin(token_lstm, image_tokens),
                      token_grid=(28 // PATCH, 28 // PATCH)),
}
"""The built-in networks, by key (the dropdown's order); ``"vit-lora"`` only where transformers and peft are
installed (:func:`installed`)."""

VIT_HIDDEN = 32  # the ViT's hidden size (notebook 06: 64); the width slider is the LoRA rank
VIT_FIRST = "model.base_model.model.vit.layers.0.attention.q_proj.lora_A.default"  # block 0's query adapter, its A


def installed(*names: str) -> bool:
    """Whether every package of ``names`` can be imported (looked up, not imported: transformers is slow to import)."""
    return all(importlib.util.find_spec(name) is not None for name in names)


def _vit_lora(rank: int) -> nn.Module:
    from pergrad_viz.tutorial.hf_models import fashion_vit_lora

    return fashion_vit_lora(rank, hidden=VIT_HIDDEN)


if installed("transformers", "peft"):
    MENU["vit-lora"] = ModelSpec(
        "vit-lora", "tiny ViT with LoRA adapters (Hugging Face + peft)", "LoRA rank",
        f"LoRA rank r: each adapter adds B A (A: r x {VIT_HIDDEN}, B: {VIT_HIDDEN} x r) to the query and value "
        "projections of both blocks; only the adapters and the classifier head are trained", (1, 2, 4, 8, 16, 32), 8,
        32, "image", VIT_FIRST, FASHION, _builtin(_vit_lora, lambda x: x.reshape(-1, 1, 28, 28)),
        imports=("transformers", "transformers.models.vit.modeling_vit", "peft"))  # 2-4 s on 2 busy cores

TOKENS_NOTE = (f"each 7x7 patch of the image is one token, its mean brightness in {VOCAB} levels (0 = black); "
               "a simple tokenizer, so that the sequence can be read")


# ------------------------------------------------------------------------------------------ a user's network


def _concat(parts: list[object]) -> object:
    """Batches (nests of tensors with B first) joined along B."""
    flat = [tree_flatten(p) for p in parts]
    leaves = [torch.cat(ts) if isinstance(ts[0], torch.Tensor) else ts[0] for ts in zip(*(f[0] for f in flat),
                                                                                        strict=True)]
    return tree_unflatten(leaves, flat[0][1])


def _take(data: object, most: int) -> tuple[object, object]:
    """(inputs, targets) of at most ``most`` samples from a tuple ``(inputs, targets)``, a Dataset of
    ``(input, target)`` pairs or a DataLoader yielding ``(inputs, targets)`` batches."""
    from torch.utils.data import DataLoader, Dataset, default_collate

    if isinstance(data, DataLoader):
        parts, n = [], 0
        for batch in data:
            parts.append(batch)
            n += Batch.of(batch[0]).size
            if n >= most:
                break
        if not parts:
            raise ValueError("data holds no sample: pass a Dataset or DataLoader of at least one (input, target)")
        inputs, targets = _concat([p[0] for p in parts]), _concat([p[1] for p in parts])
    elif isinstance(data, Dataset):
        try:
            size = len(data)
        except TypeError:
            size = most
        items = [data[i] for i in range(min(size, most))]
        if not items:
            raise ValueError("data holds no sample: pass a Dataset or DataLoader of at least one (input, target)")
        inputs, targets = default_collate(items)
    elif isinstance(data, (tuple, list)) and len(data) == 2:
        inputs, targets = data
    else:
        raise TypeError(f"data must be (inputs, targets), a Dataset of (input, target) pairs or a DataLoader, got "
                        f"{type(data).__name__}")
    size = Batch.of(inputs).size
    other = next((t.shape[0] for t in tree_flatten(targets)[0] if isinstance(t, torch.Tensor) and t.dim()
                  and t.shape[0] != size), None)
    if other is not None:  # cut to B each, the inputs' and targets' counts would not be the user's own
        raise ValueError(f"data's inputs hold {size} samples but its targets {other}: pass one target per input sample "
                         "(the same first dimension)")
    keep = min(size, most)
    return cut(inputs, slice(0, keep), size), cut(targets, slice(0, keep), size)


def _labels(targets: object, size: int) -> torch.Tensor:
    """(B,) class labels where the targets say them (class indices or one-hot rows), else -1."""
    t = targets if isinstance(targets, torch.Tensor) else None
    if t is not None and t.shape[:1] == (size,):
        if t.dim() == 1 and not t.is_floating_point():
            return t.detach().long().cpu()
        one_hot = t.dim() == 2 and t.shape[1] > 1 and t.is_floating_point() and bool(
            ((t == 0) | (t == 1)).all() and (t.sum(1) == 1).all())  # not regression targets (B, 1) or (B, k)
        if one_hot:
            return t.detach().argmax(1).cpu()
    return torch.full((size,), -1, dtype=torch.long)


def _sample_kind(inputs: object) -> tuple[str, tuple[int, int] | None]:
    """How a user's sample is drawn: an image (one tensor, a square number of at least 64 pixels per sample, or
    (B, C in {1, 3}, H, W)), tokens (one integer (B, T) tensor, or a dict's ``input_ids``: a Hugging Face batch) or
    not at all."""
    if isinstance(inputs, Mapping) and isinstance(ids := inputs.get("input_ids"), torch.Tensor):
        return ("tokens", None) if ids.dim() == 2 and not ids.is_floating_point() else ("other", None)
    if not isinstance(inputs, torch.Tensor):
        return "other", None
    one = inputs[0]
    if not one.is_floating_point():
        return ("tokens", None) if one.dim() == 1 else ("other", None)
    if one.dim() == 3 and one.shape[0] in (1, 3) or one.dim() == 2:
        return "image", None
    side = int(one.numel() ** 0.5)
    return ("image", None) if one.dim() == 1 and side * side == one.numel() and side >= 8 else ("other", None)


def first_rule_layer(model: nn.Module) -> str | None:
    """The first Linear, Conv2d or Embedding in ``named_modules`` order with trainable weights (its closed-form
    rule is the one the panel explains), or None."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d, nn.Embedding)) and module.weight.requires_grad:
            return name
    return None


def user_spec(model: nn.Module, loss_fn: Callable, data: object, *, max_batch: int = 256,
              class_names: Sequence[str] | None = None,
              output: Callable[[object], torch.Tensor] | None = None) -> ModelSpec:
    """A spec for the user's ``model`` and ``data``; its problem at batch B is the model itself (never copied,
    trained or changed) with the first B samples.

    Args:
        data: ``(inputs, targets)`` (inputs as ``per_sample_grads`` takes them: a tensor, a tuple, a dict; B
            first), a Dataset of ``(input, target)`` pairs or a DataLoader of ``(inputs, targets)`` batches.
        max_batch: at most this many samples are taken from the data.
        class_names: names of integer labels (targets that are class indices or one-hot rows).
        output: for the output Jacobian, the tensor of the model's output (``lambda out: out.logits`` for a
            Hugging Face model), as ``per_sample_jacobian``'s ``output=``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if output is not None and not callable(output):
        raise TypeError(f"output must be a function of the model's output (e.g. lambda out: out.logits), got "
                        f"{type(output).__name__}")
    inputs, targets = _take(data, max_batch)
    size = Batch.of(inputs).size
    labels = _labels(targets, size)
    if class_names is not None and len(labels) and int(labels.max()) >= len(class_names):
        raise ValueError(f"class_names has {len(class_names)} names, but the targets hold class {int(labels.max())}: "
                         "give one name per class (index k names class k), or leave class_names out")
    kind, _ = _sample_kind(inputs)
    length = None
    if kind == "tokens":
        t = (inputs["input_ids"] if isinstance(inputs, Mapping) else inputs).shape[1]
        side = int(t ** 0.5)
        length = (side, side) if side * side == t else (1, t)

    def make(batch: int, width: int) -> Problem:
        if batch > size:
            raise ValueError(f"batch size {batch} is more than the {size} samples of the data")
        return model, loss_fn, cut(inputs, slice(0, batch), size), cut(targets, slice(0, batch), size), labels[:batch]

    name = type(model).__name__
    return ModelSpec("yours", f"your model ({name})", "", f"your {name} as it is (its width is fixed)", (0,), 0,
                     min(32, size), kind, first_rule_layer(model), tuple(class_names) if class_names else None, make,
                     token_grid=length, max_batch=size, output=output)


def menu(keys: Iterable[str] | None = None) -> Mapping[str, ModelSpec]:
    """The built-in specs named by ``keys`` (default all), in the menu's order."""
    if keys is None:
        return dict(MENU)
    keys = list(keys)
    unknown = [k for k in keys if k not in MENU]
    if unknown:
        raise ValueError(f"unknown models {unknown}; the menu has {', '.join(MENU)}")
    return {k: MENU[k] for k in MENU if k in keys}
