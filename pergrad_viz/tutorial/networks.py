"""The networks from the tutorial, plus a small CNN and two small sequence models.

* :class:`MLP` – ``MLP(784, 20, 10)``: Linear -> ReLU -> Linear on flattened 28x28 images.
* :func:`bias_free_net` – the bias-free ``2 -> 16 -> 2`` network of the classic per-sample gradient question.
* :class:`SmallCNN` – two convolutions (stride, padding, groups) and GroupNorm, for 1x28x28 images.
* :class:`TransformerClassifier`, :class:`LSTMClassifier` – small sequence classifiers on (B, T, d) features (the
  benchmark's ``transformer`` and ``lstm``, :mod:`pergrad_viz.bench.problems`).
* :func:`token_transformer`, :func:`token_lstm` – a token Embedding, then one of those, for (B, T) token ids such as
  :func:`image_tokens` of an image.
* :func:`load_model` – ``MLP`` or ``SmallCNN`` by name, seeded or from a checkpoint (``python -m pergrad_viz scan``).
"""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    """Two-layer perceptron ``in_features -> hidden -> out_features`` with a ReLU.

    Input (B, in_features) (or (B, 1, 28, 28), flattened), output (B, out_features).
    """

    def __init__(self, in_features: int = 784, hidden: int = 20, out_features: int = 10, bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=bias)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x.flatten(1))))


def bias_free_net(in_features: int = 2, hidden: int = 16, out_features: int = 2) -> nn.Sequential:
    """The bias-free ``2 -> 16 -> 2`` network: input (B, 2), output (B, 2)."""
    return nn.Sequential(
        nn.Linear(in_features, hidden, bias=False),
        nn.ReLU(),
        nn.Linear(hidden, out_features, bias=False),
    )


class SmallCNN(nn.Module):
    """A small CNN for (B, 1, 28, 28) images, output (B, n_classes).

    conv(1->8, k3, pad 1) -> GroupNorm(2, 8) -> ReLU -> conv(8->16, k3, stride 2, pad 1, groups 2) -> ReLU
    -> mean over space -> Linear(16 -> n_classes).

    ``channels`` (even) sets the width: conv1 has that many output channels, conv2 twice as many.
    """

    def __init__(self, n_classes: int = 10, channels: int = 8):
        super().__init__()
        if channels < 2 or channels % 2:
            raise ValueError(f"channels must be an even number >= 2 (GroupNorm(2, c), groups=2), got {channels}")
        self.conv1 = nn.Conv2d(1, channels, kernel_size=3, padding=1)
        self.norm1 = nn.GroupNorm(2, channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, kernel_size=3, stride=2, padding=1, groups=2)
        self.head = nn.Linear(2 * channels, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            x = x.view(-1, 1, 28, 28)
        x = torch.relu(self.norm1(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))


VOCAB = 16  # brightness levels of image_tokens
PATCH = 7  # image_tokens' patch side: a 28x28 image becomes 4x4 = 16 tokens


def image_tokens(images: torch.Tensor, *, mean: float = 0.2860, std: float = 0.3530, patch: int = PATCH,
                 vocab: int = VOCAB) -> torch.Tensor:
    """A deliberately simple tokenizer for the sequence models: each ``patch x patch`` patch of a 28x28 image
    becomes one token, its mean brightness quantised to ``vocab`` levels (0 = black .. vocab-1 = white).

    Args:
        images: (B, 784) or (B, 1, 28, 28) images normalised with ``mean`` and ``std`` (as ``load_sample``'s).

    Returns:
        (B, T) int64 token ids in raster order, T = (28 / patch)^2 (16 for the default 7x7 patches).
    """
    pixels = (images.reshape(-1, 1, 28, 28) * std + mean).clamp(0, 1)
    levels = nn.functional.avg_pool2d(pixels, patch).flatten(1)  # (B, T) in [0, 1]
    return (levels * vocab).long().clamp(0, vocab - 1)


class TransformerClassifier(nn.Module):
    """(B, T, d) -> TransformerEncoder -> mean over T -> Linear -> (B, classes)."""

    def __init__(self, d_model: int = 64, heads: int = 4, feedforward: int = 128, layers: int = 2,
                 classes: int = 10):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model, heads, feedforward, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))


class LSTMClassifier(nn.Module):
    """(B, T, in) -> 2-layer LSTM -> last step -> Linear -> (B, classes)."""

    def __init__(self, features: int = 32, hidden: int = 64, layers: int = 2, classes: int = 10):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, -1])


class TokenClassifier(nn.Module):
    """(B, T) token ids -> ``embed`` (an Embedding) -> ``body`` ((B, T, d) -> (B, classes))."""

    def __init__(self, embed: nn.Embedding, body: nn.Module):
        super().__init__()
        self.embed = embed
        self.body = body

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens))


def token_transformer(d_model: int = 32, *, vocab: int = VOCAB, classes: int = 10) -> TokenClassifier:
    """Embedding(vocab, d_model) -> 1-layer TransformerEncoder (4 heads, or 1 where d_model is not a multiple of 4;
    feed-forward 2 d_model, no dropout, eval mode) -> mean over tokens -> Linear: (B, T) -> (B, classes)."""
    heads = 4 if d_model % 4 == 0 else 1
    model = TokenClassifier(nn.Embedding(vocab, d_model),
                            TransformerClassifier(d_model, heads, 2 * d_model, layers=1, classes=classes))
    return model.eval()


def token_lstm(hidden: int = 32, *, vocab: int = VOCAB, features: int = 16, classes: int = 10) -> TokenClassifier:
    """Embedding(vocab, features) -> 1-layer batch-first LSTM(features -> hidden) -> last step -> Linear:
    (B, T) -> (B, classes)."""
    return TokenClassifier(nn.Embedding(vocab, features), LSTMClassifier(features, hidden, layers=1, classes=classes))


def load_model(name: str, checkpoint: str | None, hidden: int = 20, seed: int = 0) -> nn.Module:
    """MLP(784, hidden, 10) (``name="mlp"``) or SmallCNN, from a checkpoint (a state_dict, or a dict holding one
    under 'state_dict' / 'model') or seeded; in eval mode."""
    torch.manual_seed(seed)
    model = MLP(784, hidden, 10) if name == "mlp" else SmallCNN()
    if checkpoint:
        try:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise SystemExit(f"error: --checkpoint {checkpoint} does not exist") from None
        except Exception as exc:  # noqa: BLE001 (a whole pickled model, a corrupt or foreign file: torch's many kinds)
            raise SystemExit(f"error: --checkpoint {checkpoint} is not a state_dict torch.load(weights_only=True) "
                             f"can read ({type(exc).__name__}: a whole pickled model, or not a checkpoint); save the "
                             "weights with torch.save(model.state_dict(), path)") from None
        if isinstance(state, dict) and ("state_dict" in state or "model" in state):
            state = state.get("state_dict", state.get("model"))
        try:
            model.load_state_dict(state)
        except (RuntimeError, TypeError) as exc:
            width = state.get("fc1.weight") if isinstance(state, dict) else None
            hint = (f" (its hidden width is {width.shape[0]}: pass --hidden {width.shape[0]})"
                    if name == "mlp" and isinstance(width, torch.Tensor) and width.dim() == 2 else "")
            raise SystemExit(f"error: {checkpoint} does not fit --model {name}{hint}: {exc}") from None
    return model.eval()
