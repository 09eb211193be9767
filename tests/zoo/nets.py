"""The small test networks, defined once: the agreement grid's models and their builder (``build_net(name)`` for
every name in ``CASES``), and the networks the norms, NTK and zoo tests share.

Models that differ only in a detail have names that say it: ``TiedEmbeddingHeadNet`` (the embedding tied to the
output Linear) and ``DoublyTiedNet`` (that, and two hidden Linears tied); ``SharedLinearNet`` (one Linear called
twice) and ``SharedLinearAndNormNet`` (a Linear and a LayerNorm each called twice); ``ScaleByScale`` and
``ScaleByWeight`` (a custom parameter named ``scale`` or ``weight``).
"""

from __future__ import annotations

import torch
from torch import nn

from pergrad_viz.tutorial import networks as models

# ------------------------------------------------------------------------------ the agreement grid's models


class Seq2Flat(nn.Module):
    """Wraps a body and a Linear head on its flattened output (sized by a dry run)."""

    def __init__(self, body: nn.Module, example: torch.Tensor, classes: int = 3):
        super().__init__()
        self.body = body
        with torch.no_grad():
            n = body(example[:1]).numel()
        self.head = nn.Linear(n, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).flatten(1))


class EmbeddingNet(nn.Module):
    """Embedding (with padding_idx) -> Linear over (B, T, D) -> logits (B, C, T)."""

    def __init__(self, vocab=7, dim=4, classes=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=0)
        self.proj = nn.Linear(dim, classes)

    def forward(self, idx):
        return self.proj(torch.tanh(self.emb(idx))).transpose(1, 2)


class TiedEmbeddingHeadNet(nn.Module):
    """An Embedding whose weight is tied to the output Linear's (as in language models)."""

    def __init__(self, vocab=6, dim=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab)
        self.out.weight = self.emb.weight

    def forward(self, idx):  # (B, T) -> (B, vocab)
        return self.out(torch.tanh(self.mid(self.emb(idx)))).mean(1)


class LayerNormNet(nn.Module):
    def __init__(self, t=3, d=4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d, eps=0.1)  # non-default eps: a rule must use the layer's
        self.ln2 = nn.LayerNorm((t, d), eps=0.05, bias=False)
        self.ln3 = nn.LayerNorm(d, elementwise_affine=False)
        self.out = nn.Linear(d, 2)
        self.ln1.weight.requires_grad_(False)  # bias only

    def forward(self, x):  # (B, T, D) -> (B, T, 2)
        h = self.ln1(self.inp(x))
        h = self.ln3(self.ln2(torch.tanh(h)))
        return self.out(h)


class GroupNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.gn1 = nn.GroupNorm(2, 4, eps=0.1)
        self.gn2 = nn.GroupNorm(4, 4)
        self.fc = nn.Linear(4 * 3 * 3, 4)
        self.gn3 = nn.GroupNorm(2, 4)  # on (B, C) vectors
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # (B, 2, 5, 5)
        h = torch.tanh(self.gn2(torch.tanh(self.gn1(self.conv(x)))))
        h = self.gn3(self.fc(h.flatten(1)))
        return self.head(torch.tanh(h))


class BatchNormEvalNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(3, eps=0.1)
        self.fc = nn.Linear(3 * 4 * 4, 5)
        self.bn1 = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 3)
        self.conv.weight.requires_grad_(False)  # bias only
        self.bn1.bias.requires_grad_(False)  # weight only

    def forward(self, x):
        h = torch.tanh(self.bn2(self.conv(x))).flatten(1)
        return self.head(torch.tanh(self.bn1(self.fc(h))))


class FrozenNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)  # fully frozen
        self.b = nn.Linear(5, 5)  # weight frozen, bias trainable
        self.c = nn.Linear(5, 3)  # trainable
        self.a.requires_grad_(False)
        self.b.weight.requires_grad_(False)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class SharedLinearNet(nn.Module):
    """The same Linear called twice in forward (weight sharing)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.shared = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h) + h)
        return self.head(h)


class UnusedNet(nn.Module):
    """A layer never called, and one called whose result does not reach the output: both get zeros."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.unused = nn.Linear(5, 5)
        self.dead = nn.Linear(5, 2)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.fc(x))
        self.dead(h)
        return self.head(h)


class Out23Net(nn.Module):
    """Output of shape (B, 2, 3): Y = 6 once flattened."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.out = nn.Linear(5, 6)

    def forward(self, x):
        return self.out(torch.tanh(self.fc(x))).view(-1, 2, 3)


class ScaleByScale(nn.Module):
    """A custom module with its own nn.Parameter (named ``scale``): no hooks rule."""

    def __init__(self, n):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x):
        return x * self.scale


class UnsupportedNet(nn.Module):
    """Layers without a hooks rule: a custom module with its own parameter, and nn.Bilinear."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.scale = ScaleByScale(5)
        self.bilinear = nn.Bilinear(5, 5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.scale(torch.tanh(self.fc(x)))
        return self.head(torch.tanh(self.bilinear(h, h)))


class PReLUNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.act = nn.PReLU(5, init=0.3)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.act(self.fc(x)))


CONV_CONFIGS = {
    "2d-stride-pad": (nn.Conv2d, dict(in_channels=2, out_channels=4, kernel_size=3, stride=2, padding=1), (2, 7, 6)),
    "2d-same-dil-groups-reflect": (
        nn.Conv2d,
        dict(in_channels=4, out_channels=6, kernel_size=3, padding="same", dilation=2, groups=2,
             padding_mode="reflect"),
        (4, 7, 7),
    ),
    "2d-same-even-kernel-circular": (
        nn.Conv2d, dict(in_channels=2, out_channels=3, kernel_size=(2, 3), padding="same", padding_mode="circular"),
        (2, 5, 6),
    ),
    "2d-valid-stride-tuple-nobias": (
        nn.Conv2d, dict(in_channels=2, out_channels=4, kernel_size=(3, 2), padding="valid", stride=(1, 2),
                        bias=False), (2, 6, 7),
    ),
    "2d-asym-pad-replicate-depthwise": (
        nn.Conv2d, dict(in_channels=3, out_channels=6, kernel_size=3, padding=(1, 2), padding_mode="replicate",
                        groups=3, dilation=(2, 1)), (3, 6, 5),
    ),
    "1d-stride-pad-dil": (
        nn.Conv1d, dict(in_channels=3, out_channels=4, kernel_size=3, stride=2, padding=2, dilation=2), (3, 9),
    ),
    "1d-same-even-reflect-groups": (
        nn.Conv1d, dict(in_channels=4, out_channels=4, kernel_size=4, padding="same", padding_mode="reflect",
                        groups=4), (4, 8),
    ),
    "1d-valid": (nn.Conv1d, dict(in_channels=2, out_channels=3, kernel_size=2, padding="valid"), (2, 6)),
    "1d-circular-groups": (
        nn.Conv1d, dict(in_channels=4, out_channels=6, kernel_size=3, padding=1, padding_mode="circular", groups=2),
        (4, 7),
    ),
}


def _classes(b, c=3):
    return torch.arange(b) % c


def build_net(name: str):
    """(model, inputs, targets, loss_fn, b_j) in float64 on the CPU, deterministic, for a name in ``CASES``; the
    Jacobian tests take the first ``b_j`` samples."""
    torch.manual_seed(0)
    b = 5
    if name == "mlp":
        model, x, y, loss = models.MLP(784, 6, 10), torch.randn(b, 1, 28, 28), _classes(b, 10), nn.CrossEntropyLoss()
        b_j = 3  # fewer samples for the (B, 10, P) Jacobian
        return model, x, y, loss, b_j
    if name in ("bias-free-mse-sum", "bias-free-mse-mean"):
        reduction = name.rsplit("-", 1)[1]
        return models.bias_free_net(), torch.randn(b, 2), torch.randn(b, 2), nn.MSELoss(reduction=reduction), b
    if name == "small-cnn":
        return models.SmallCNN(4), torch.randn(3, 1, 8, 8), _classes(3, 4), nn.CrossEntropyLoss(), 2
    if name.startswith("conv-"):
        cls, kw, shape = CONV_CONFIGS[name[5:]]
        x = torch.randn(b, *shape)
        return Seq2Flat(cls(**kw), x), x, _classes(b), nn.CrossEntropyLoss(reduction="sum"), 3
    if name == "embedding":
        x = torch.tensor([[1, 2, 1, 0], [3, 3, 3, 3], [0, 0, 5, 6], [6, 5, 4, 6], [2, 0, 2, 1]])  # repeats, padding
        y = torch.tensor([[0, 1, 2, 0], [1, 1, 2, 0], [2, 0, 1, 1], [0, 0, 0, 2], [1, 2, 0, 1]])
        return EmbeddingNet(), x, y, nn.CrossEntropyLoss(), 3
    if name == "tied":
        x = torch.tensor([[1, 2, 1], [3, 3, 0], [5, 4, 2], [0, 1, 5], [2, 2, 2]])
        return TiedEmbeddingHeadNet(), x, torch.tensor([0, 3, 5, 1, 2]), nn.CrossEntropyLoss(), 3
    if name == "layernorm":
        return LayerNormNet(), torch.randn(b, 3, 4), torch.randn(b, 3, 2), nn.MSELoss(), 3
    if name == "groupnorm":
        return GroupNormNet(), torch.randn(b, 2, 5, 5), _classes(b), nn.CrossEntropyLoss(), 3
    if name == "batchnorm-eval":
        model = BatchNormEvalNet()
        for bn in (model.bn1, model.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(bn.weight, 0.5, 1.5)
            nn.init.uniform_(bn.bias, -0.5, 0.5)
        return model.eval(), torch.randn(b, 2, 4, 4), _classes(b), nn.CrossEntropyLoss(), 3
    if name == "frozen":
        return FrozenNet(), torch.randn(b, 4), _classes(b), nn.CrossEntropyLoss(), b
    if name == "shared":
        return SharedLinearNet(), torch.randn(b, 4), _classes(b), nn.CrossEntropyLoss(), b
    if name == "relu-inplace":
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 3))
        return model, torch.randn(b, 4), _classes(b), nn.CrossEntropyLoss(), b
    if name == "unused":
        return UnusedNet(), torch.randn(b, 4), _classes(b), nn.CrossEntropyLoss(), b
    if name == "out-2x3":
        return Out23Net(), torch.randn(b, 4), torch.randn(b, 2, 3), nn.MSELoss(reduction="sum"), b
    if name == "unsupported":
        return UnsupportedNet(), torch.randn(b, 4), _classes(b), nn.CrossEntropyLoss(), b
    if name == "prelu":
        return PReLUNet(), torch.randn(b, 4), _classes(b), nn.CrossEntropyLoss(), b
    raise KeyError(name)


CASES = ["mlp", "bias-free-mse-sum", "bias-free-mse-mean", "small-cnn", *(f"conv-{k}" for k in CONV_CONFIGS),
         "embedding", "tied", "layernorm", "groupnorm", "batchnorm-eval", "frozen", "shared", "relu-inplace", "unused",
         "out-2x3", "unsupported", "prelu"]
# "unsupported": layers with parameters but no closed-form rule (hooks uses the per-layer fallback there)


# ---------------------------------------------------------------------- shared by the norms, NTK and zoo tests


class DoublyTiedNet(nn.Module):
    """An Embedding and the output Linear share one weight; two hidden Linears share another."""

    def __init__(self, vocab: int = 10):
        super().__init__()
        self.emb = nn.Embedding(vocab, 4, padding_idx=1)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4, bias=False)
        self.fc2.weight = self.fc1.weight
        self.out = nn.Linear(4, vocab)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(self.emb(x).mean(1)))
        return self.out(torch.tanh(self.fc2(h)))


class ScaleByWeight(nn.Module):
    """A layer with a trainable parameter (named ``weight``) and no rule: forces the fallbacks."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class TokenNet(nn.Module):
    """Embedding (padding_idx 0) -> Linear on (B, T, D) -> mean over T -> Linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, 6, padding_idx=0)
        self.fc = nn.Linear(6, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc(self.emb(x))).mean(1))


class SharedLinearAndNormNet(nn.Module):
    """A Linear and a LayerNorm each called twice (their gradient is the sum of both calls')."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.ln = nn.LayerNorm(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(torch.tanh(self.fc(x)))
        h = self.ln(torch.tanh(self.fc(h)))
        return self.head(h)


class FlatRows(nn.Module):
    """A Linear called on (B*T, D) rows: the samples are not along its input's first dimension."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        return self.fc(x.reshape(b * t, d)).reshape(b, t, 3).mean(1)


class LastSeesPrevious(nn.Module):
    """From 3 samples on, the last sample's hidden layer adds half the previous sample's (``detached``: without a cross
    term): samples that interact only in batches larger than the probe's pair, one row touched."""

    def __init__(self, inputs: int = 5, detached: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(inputs, 6), nn.Linear(6, 3)
        self.detached = detached

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if h.shape[0] > 2:
            previous = h[-2:-1].detach() if self.detached else h[-2:-1]
            h = torch.cat([h[:-1], h[-1:] + 0.5 * previous])
        return self.b(h)
