"""The model zoo as data: real architectures built small, and adversarial models, each a :class:`Case`.

``tests/strategies/test_zoo.py`` checks every case against the reference loops of ``tests/helpers.py``: every
strategy either gives exactly the loop's numbers or raises ``pv.UnsupportedModelError``; ``"auto"`` always
gives the loop's numbers (unless the case's ``expect`` is ``"refuse"``).

``expect`` is what ``pv.resolve_strategy("auto", model, x)`` should give (before any per-sample computation: a
per-call check that fails later sends ``auto`` to ``torch_func`` from then on), for every batch or one per batch:

* ``"hooks"``: every real architecture (rules, plus a per-layer fallback for layers without a closed-form
  rule: MultiheadAttention, Bilinear, RNNs, custom parameters, ...), and models whose only trap is the loss
  (``resolve_strategy`` does not see the loss, the per-sample losses must still be right);
* ``"torch_func"``: models whose samples interact, or with a layer that does not see the samples along its
  first dimension (sequence-first, (B*T, d) after a reshape, a (1, T) positional input, an RNN's h_n);
* ``"refuse"``: ``resolve_strategy`` and every strategy raise ``pv.UnsupportedModelError``.

All models are float64 and seeded; inputs are seeded by (case, batch size) and do not touch the global RNG.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torchvision
from torch import nn
from zoo.nets import ScaleByWeight

DT = torch.float64
Inputs = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Case:
    name: str
    make_model: Callable[[], nn.Module]
    make_inputs: Callable[[int], Inputs]  # batch -> (x, y)
    loss_fns: dict[str, Callable[[], Callable]] = field(default_factory=lambda: {"ce": nn.CrossEntropyLoss})
    jacobian: bool = True  # also check per-sample Jacobians (Y <= 6)
    expect: str | tuple[str, ...] = "hooks"  # "hooks" | "torch_func" | "refuse", or one per batch
    batches: tuple[int, ...] = (3,)  # run in this order on ONE model instance
    expensive: bool = False  # skip the slow baseline strategies (loop, autograd_stack, batched_grad)
    before_call: Callable[[nn.Module, int], None] | None = None  # puts the model in its state for call k

    def expects(self, k: int) -> str:
        """What ``resolve_strategy("auto")`` should give on call k (before any per-sample computation)."""
        return self.expect if isinstance(self.expect, str) else self.expect[k]

    def prepare(self, model: nn.Module, k: int) -> nn.Module:
        """``model`` in its state for call k."""
        if self.before_call is not None:
            self.before_call(model, k)
        return model

    def __repr__(self) -> str:
        return f"Case({self.name})"


# ------------------------------------------------------------------------------------------------ helpers


def seeded(name: str, batch: int) -> torch.Generator:
    """A generator seeded by (case name, batch size): inputs that do not touch the global RNG."""
    return torch.Generator().manual_seed(zlib.crc32(name.encode()) + 1000 * batch)


def floats(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """``shape`` normal float64 values drawn from ``gen``, times ``scale``."""
    return scale * torch.randn(*shape, generator=gen, dtype=DT)


def labels(batch: int, gen: torch.Generator, n: int = 3) -> torch.Tensor:
    """(batch,) class labels in [0, n) drawn from ``gen``."""
    return torch.randint(0, n, (batch,), generator=gen)


def image_inputs(name: str, shape: tuple[int, ...], classes: int = 3) -> Callable[[int], Inputs]:
    """batch -> ((batch, *shape) floats, (batch,) labels), seeded by (name, batch)."""
    def make(batch: int) -> Inputs:
        g = seeded(name, batch)
        return floats(batch, *shape, gen=g), labels(batch, g, classes)

    return make


def token_inputs(name: str, t: int, vocab: int) -> Callable[[int], Inputs]:
    """batch -> ((batch, t) token ids with a padding 0 and a repeated token, (batch,) labels)."""
    def make(batch: int) -> Inputs:
        g = seeded(name, batch)
        x = torch.randint(0, vocab, (batch, t), generator=g)
        x[0, -1] = 0  # a padding token
        x[-1, 0] = x[-1, 1]  # a repeated token
        return x, labels(batch, g)

    return make


def build(fn: Callable[[], nn.Module], mode: str = "train",
          calibrate: tuple[int, ...] | None = None) -> Callable[[], nn.Module]:
    """A case's ``make_model``: ``fn()`` seeded, in float64, with non-trivial norm statistics, in ``mode``.
    ``calibrate``: an input shape (without the batch) to set BatchNorm's running statistics from, so that a
    deep network in eval mode neither blows up nor lets its first layers' gradients vanish."""

    def make() -> nn.Module:
        torch.manual_seed(0)
        model = fn().to(DT)
        _randomise_norms(model)
        if calibrate is not None:
            _calibrate_norms(model, calibrate)
        return model.train(mode == "train")

    return make


@torch.no_grad()
def _randomise_norms(model: nn.Module) -> None:
    """Non-trivial running statistics and affine parameters (defaults make BatchNorm almost the identity)."""
    g = torch.Generator().manual_seed(7)
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase):
            if m.running_mean is not None:
                m.running_mean.copy_(0.4 * torch.rand(m.running_mean.shape, generator=g, dtype=DT) - 0.2)
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=g, dtype=DT))
            if m.affine:
                m.weight.copy_(0.5 + torch.rand(m.weight.shape, generator=g, dtype=DT))
                m.bias.copy_(0.4 * torch.rand(m.bias.shape, generator=g, dtype=DT) - 0.2)


@torch.no_grad()
def _calibrate_norms(model: nn.Module, shape: tuple[int, ...]) -> None:
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average
    model.train()
    model(torch.randn(16, *shape, generator=torch.Generator().manual_seed(3), dtype=DT))
    for m in bns:
        m.momentum = 0.1


# ------------------------------------------------------------------------------------ real architectures


def _resnet18() -> nn.Module:
    model = torchvision.models.resnet18(weights=None, num_classes=3)
    # P = 11.2M in all; keep the stem (7x7 stride-2 conv, BN), a down-sampling block (strided 3x3 and 1x1
    # convs, BN), one deep BN and the head trainable: P = 241k, gradients flow through the frozen layers.
    keep = ("conv1.", "bn1.", "layer2.0.", "layer4.1.bn2.", "fc.")
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(keep))
    return model


def _vit() -> nn.Module:
    """A tiny torchvision VisionTransformer: a class token and position embedding held by modules whose forward
    uses them directly (per-layer fallback), self-attention (closed form), LayerNorm, MLP blocks."""
    from torchvision.models.vision_transformer import VisionTransformer

    model = VisionTransformer(image_size=16, patch_size=8, num_layers=1, num_heads=2, hidden_dim=8, mlp_dim=16,
                              num_classes=3)
    nn.init.normal_(model.heads.head.weight)  # torchvision starts the head at zero: every gradient would be 0
    nn.init.normal_(model.class_token)
    return model


def _shufflenet() -> nn.Module:
    """torchvision ShuffleNetV2 x0.5: channel shuffles, depthwise (grouped) convolutions, BatchNorm in eval."""
    return torchvision.models.shufflenet_v2_x0_5(weights=None, num_classes=3)


def _mobilenet() -> nn.Module:
    # depthwise convs, squeeze-excitation (convs on (B, C, 1, 1)), Hardswish, BN, Dropout (eval): P = 1.5M
    return torchvision.models.mobilenet_v3_small(weights=None, num_classes=3)


class TransformerClassifier(nn.Module):
    """nn.TransformerEncoder (2 layers, d_model 8, 2 heads) on (B, T, 8), mean over T, Linear head."""

    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(x).mean(1))


class SequenceFirstTransformer(nn.Module):
    """PyTorch's default layout: tokens (B, T) -> Embedding on (T, B) -> nn.TransformerEncoder (batch_first=False,
    a key padding mask from token 0) -> mean over T -> Linear head. Every Embedding, Linear and LayerNorm sees the
    samples on dimension 1."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(9, 8, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d_model=8, nhead=2, dim_feedforward=16, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.head = nn.Linear(8, 3)

    def forward(self, tokens):  # (B, T)
        pad = tokens == 0
        pad[:, 0] = False  # no sample without a key
        return self.head(self.encoder(self.embed(tokens.t()), src_key_padding_mask=pad).mean(0))


class PackedRNN(nn.Module):
    """Tokens (B, T) with padding 0 -> Embedding -> pack_padded_sequence -> 2-layer LSTM / bidirectional GRU ->
    pad_packed_sequence -> sum over T -> Linear head. The packed data (tokens of all samples, (sum of lengths, d))
    has no batch dimension."""

    def __init__(self, cell: type[nn.RNNBase], bidirectional: bool):
        super().__init__()
        self.embed = nn.Embedding(9, 4, padding_idx=0)
        self.rnn = cell(4, 5, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(5 * (2 if bidirectional else 1), 3)

    def forward(self, tokens):
        from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

        lengths = (tokens != 0).sum(1).clamp_min(1).cpu()
        packed = pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        out, _ = pad_packed_sequence(self.rnn(packed)[0], batch_first=True, total_length=tokens.shape[1])
        return self.head(out.sum(1))


class RNNClassifier(nn.Module):
    """LSTM / GRU (2 layers, batch_first) on (B, T, 3) and a Linear head on one of its readouts."""

    def __init__(self, cell: type[nn.RNNBase], readout: str, bidirectional: bool = False):
        super().__init__()
        self.rnn = cell(3, 5, num_layers=2, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(5 * (2 if bidirectional else 1), 3)
        self.readout = readout

    def forward(self, x):
        out, h = self.rnn(x)
        h_n = h[0] if isinstance(h, tuple) else h  # (layers * directions, B, H)
        if self.readout == "last":
            return self.head(out[:, -1])
        if self.readout == "mean":  # (out[:, -1] would not reach the last layer's reverse weight_hh)
            return self.head(out.mean(1))
        if self.readout == "h_n":
            return self.head(h_n[-1])
        if self.readout == "h_n_all":  # the head sees (layers, B, H): not batch-first
            return self.head(h_n).mean(0)
        raise ValueError(self.readout)


class SelfAttentionNet(nn.Module):
    """Linear -> nn.MultiheadAttention(8, 2) as self-attention (residual) -> LayerNorm -> mean over T -> head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.head(self.norm(h + a).mean(1))


class FlatHead(nn.Module):
    """A body, then tanh, flatten and a Linear head sized by a dry run on ``example_shape``."""

    def __init__(self, body: nn.Module, example_shape: tuple[int, ...]):
        super().__init__()
        self.body = body
        with torch.no_grad():
            n = body(torch.zeros(1, *example_shape)).numel()
        self.head = nn.Linear(n, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).flatten(1))


class BilinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.b = nn.Linear(4, 5)
        self.bilinear = nn.Bilinear(5, 5, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.bilinear(torch.tanh(self.a(x)), torch.tanh(self.b(x)))))


class ClsAndPosition(nn.Module):
    """A learned cls token concatenated in front of the sequence, plus a learned positional parameter."""

    def __init__(self, t: int, d: int):
        super().__init__()
        self.cls = nn.Parameter(0.5 * torch.randn(1, 1, d))
        self.pos = nn.Parameter(0.5 * torch.randn(1, t + 1, d))

    def forward(self, x):  # (B, T, d) -> (B, T + 1, d)
        return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos


class ClsTokenNet(nn.Module):
    def __init__(self, t: int = 4):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.tokens = ClsAndPosition(t, 6)
        self.norm = nn.LayerNorm(6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):  # (B, T, 4)
        h = torch.tanh(self.mix(self.norm(self.tokens(self.inp(x)))))
        return self.head(h[:, 0] + h[:, 1:].mean(1))


class PositionalEmbeddingNet(nn.Module):
    """Token Embedding + a learned positional Embedding of torch.arange(T)[None] ((1, T): broadcast over B)."""

    def __init__(self, vocab: int = 9, t: int = 5, d: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d, padding_idx=0)
        self.pos = nn.Embedding(t, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, 3)

    def forward(self, idx):  # (B, T) int
        positions = torch.arange(idx.shape[1], device=idx.device)[None]  # (1, T)
        h = self.tok(idx) + self.pos(positions)
        return self.head(torch.tanh(self.fc(h)).mean(1))


# ------------------------------------------------------------------------------------------- adversarial


class SequenceFirstLinear(nn.Module):
    """A batch-first model whose middle Linear runs on a (T, B, d) tensor (with B == T the shapes agree)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):  # (B, T, 3)
        h = torch.tanh(self.inp(x)).transpose(0, 1)  # (T, B, 4)
        h = torch.tanh(self.mid(h)).transpose(0, 1)  # the Linear saw (T, B, 4)
        return self.head(h.mean(1))


class BatchCentering(nn.Module):
    """Centres features over the batch (h - h.mean(0)) without BatchNorm: the samples interact.

    Alone (the definition) the centred part is zero; the tanh part keeps every gradient non-zero."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        h = self.fc(x)
        return self.head(torch.tanh(h) + 0.5 * (h - h.mean(0, keepdim=True)))


class RowsNet(nn.Module):
    """A Linear on (B, T, 4), then a Linear on the (B*T, 5) rows after a reshape, mean over T, head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 5)
        self.rows = nn.Linear(5, 5)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        b, t, _ = x.shape
        h = torch.tanh(self.inp(x)).reshape(b * t, 5)
        h = torch.tanh(self.rows(h)).reshape(b, t, 5)
        return self.head(h.mean(1))


class TwoNames(nn.Module):
    """A parameter registered twice, on the parent under a second name (first in ``named_parameters()``) and as its
    child Linear's weight, used in both forwards: the child's use lies inside the parent's forward, so the parent
    handles it (the per-layer fallback), never the child's rule as well (which counted that use twice)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 3)
        self.register_parameter("alias", self.lin.weight)

    def forward(self, x):
        return self.head(torch.tanh(self.lin(x)) @ self.alias.t())


class LayerScaleTiedToBias(nn.Module):
    """A block's own scale parameter that is also its child Linear's bias (a holder's use inside another holder's
    forward, the other way round)."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)
        self.scale = self.inner.bias
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)) * self.scale)


class WrittenIntoABuffer(nn.Module):
    """A weight built by writing parameters into a fresh tensor (``w[rows, cols] = p``: peft's OFT builds its skew
    matrices so), whose parameters take part only through ``Tensor.__setitem__`` (which returns None), then a
    Linear head: (B, 4) -> (B, 3)."""

    def __init__(self):
        super().__init__()
        self.upper = nn.Parameter(torch.randn(6) * 0.5)
        self.head = nn.Linear(4, 3)
        self.rows, self.cols = torch.triu_indices(4, 4, offset=1)

    def forward(self, x):
        skew = torch.zeros(4, 4, dtype=x.dtype)
        skew[self.rows, self.cols] = self.upper
        return self.head(torch.tanh(x @ (skew - skew.T)) + x)


class QueryThroughALayer(nn.Module):
    """A learned query (1, D) that a Linear is applied to, its output broadcast over the batch: the Linear's call holds
    no samples (its output is spread per sample) and the query's gradient comes through it: (B, 4) -> (B, 3)."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 4))
        self.key, self.head = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.head(x * torch.tanh(self.key(self.query)))


class LowRankUpdate(nn.Module):
    """A parametrization with parameters of its own (LoRA written with ``register_parametrization``): W + A @ B."""

    def __init__(self, shape: torch.Size, rank: int = 2):
        super().__init__()
        self.a = nn.Parameter(torch.randn(shape[0], rank) * 0.3)
        self.b = nn.Parameter(torch.randn(rank, shape[1]) * 0.3)

    def forward(self, weight):
        return weight + self.a @ self.b


def _low_rank(module: nn.Module, name: str, freeze: bool = True) -> nn.Module:
    torch.nn.utils.parametrize.register_parametrization(module, name, LowRankUpdate(getattr(module, name).shape))
    getattr(module.parametrizations, name).original.requires_grad_(not freeze)
    return module


class ParametrizedAttention(nn.Module):
    """MultiheadAttention whose weights a trainable parametrization computes: its call rule reads the weights as
    tensors, so the parametrization's parameters take the per-layer fallback."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, batch_first=True)
        _low_rank(self.attn.out_proj, "weight")
        _low_rank(self.attn, "in_proj_weight")
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.attn(x, x, x)[0].mean(1))


class ParametrizedLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = _low_rank(nn.LSTM(6, 5, batch_first=True), "weight_hh_l0", freeze=False)
        self.head = nn.Linear(5, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _mlp(out: int) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, out))


def _regression_inputs(name: str, out_shape: tuple[int, ...]) -> Callable[[int], Inputs]:
    def make(batch: int) -> Inputs:
        g = seeded(name, batch)
        return floats(batch, 4, gen=g), floats(batch, *out_shape, gen=g)

    return make


def _loss_divided_by_batch() -> Callable:
    return lambda o, t: ((o - t) ** 2).sum() / o.shape[0]


# ------------------------------------------------------------------------------------------------- cases


def _rnn(name: str, cell, readout: str, bidirectional: bool = False, expect: str = "hooks",
         batches: tuple[int, ...] = (3,)) -> Case:
    return Case(name, build(lambda: RNNClassifier(cell, readout, bidirectional)),
                image_inputs(name, (4, 3)), expect=expect, batches=batches)


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.Tanh(), nn.AdaptiveAvgPool2d(2),
                         nn.Flatten(), nn.Linear(16, 3))


def _padded_later() -> nn.Module:
    """A stride-3 Conv2d given padding 1 after construction (a stem changed by hand): its 2 x 2 output map is the
    same size, its numbers are not."""
    conv = nn.Conv2d(2, 3, 3, stride=3)
    conv.padding = (1, 1)
    return conv


def _kernel_replaced() -> nn.Module:
    """A ConvTranspose1d whose weight was replaced by one of kernel 4 (its kernel_size still says 3)."""
    conv = nn.ConvTranspose1d(2, 3, 3, stride=2)
    conv.weight = nn.Parameter(torch.randn(2, 3, 4) * 0.3)
    return conv


CASES: list[Case] = [
    # real architectures ------------------------------------------------------------------------------
    Case("resnet18", build(_resnet18, "eval", calibrate=(3, 16, 16)), image_inputs("resnet18", (3, 16, 16)),
         batches=(2,), expensive=True),
    Case("mobilenet_v3_small", build(_mobilenet, "eval", calibrate=(3, 32, 32)),
         image_inputs("mobilenet_v3_small", (3, 32, 32)),
         batches=(2,), expensive=True),
    Case("vit-tiny", build(_vit, "eval"), image_inputs("vit-tiny", (3, 16, 16)), batches=(2,), expensive=True),
    Case("shufflenet_v2", build(_shufflenet, "eval", calibrate=(3, 32, 32)),
         image_inputs("shufflenet_v2", (3, 32, 32)), batches=(2,), expensive=True),
    Case("transformer-eval", build(TransformerClassifier, "eval"), image_inputs("transformer-eval", (5, 8)),
         expensive=True),
    Case("transformer-train", build(TransformerClassifier, "train"), image_inputs("transformer-train", (5, 8)),
         loss_fns={"ce-sum": lambda: nn.CrossEntropyLoss(reduction="sum")}, expensive=True),
    Case("transformer-sequence-first", build(SequenceFirstTransformer, "eval"),
         token_inputs("transformer-sequence-first", 5, 9), expensive=True),
    _rnn("lstm-out-last", nn.LSTM, "last"),
    _rnn("gru-h_n-last-layer", nn.GRU, "h_n"),
    _rnn("lstm-h_n-last-layer", nn.LSTM, "h_n"),
    _rnn("gru-bidirectional-out-mean", nn.GRU, "mean", bidirectional=True),
    _rnn("lstm-bidirectional-out-mean", nn.LSTM, "mean", bidirectional=True),
    Case("self-attention", build(SelfAttentionNet), image_inputs("self-attention", (4, 4))),
    Case("conv3d", build(lambda: FlatHead(nn.Conv3d(2, 3, 3, padding=1, stride=(1, 2, 2)), (2, 3, 4, 4))),
         image_inputs("conv3d", (2, 3, 4, 4))),
    Case("query-through-a-layer", build(QueryThroughALayer), image_inputs("query-through-a-layer", (4,))),
    Case("parameters-written-into-a-buffer", build(WrittenIntoABuffer),
         image_inputs("parameters-written-into-a-buffer", (4,))),
    Case("conv2d-padding-set-later", build(lambda: FlatHead(_padded_later(), (2, 6, 6))),
         image_inputs("conv2d-padding-set-later", (2, 6, 6))),
    Case("conv-transpose1d-kernel-replaced", build(lambda: FlatHead(_kernel_replaced(), (2, 5))),
         image_inputs("conv-transpose1d-kernel-replaced", (2, 5))),
    Case("conv-transpose2d",
         build(lambda: FlatHead(nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1, output_padding=1), (2, 3, 3))),
         image_inputs("conv-transpose2d", (2, 3, 3))),
    Case("instancenorm2d-affine",
         build(lambda: FlatHead(nn.Sequential(nn.Conv2d(2, 4, 3, padding=1, bias=False),  # a bias would get 0
                                              nn.InstanceNorm2d(4, affine=True)),
                                (2, 4, 4))),
         image_inputs("instancenorm2d-affine", (2, 4, 4))),
    Case("batchnorm2d-eval", build(_bn_net, "eval"), image_inputs("batchnorm2d-eval", (2, 4, 4))),
    Case("bilinear", build(BilinearNet), image_inputs("bilinear", (4,))),
    Case("custom-scale-parameter",
         build(lambda: nn.Sequential(nn.Linear(4, 5), ScaleByWeight(5), nn.Tanh(), nn.Linear(5, 3))),
         image_inputs("custom-scale-parameter", (4,))),
    # one parameter held by a parent and its child, used by both: handled by the parent alone
    Case("parameter-registered-twice", build(TwoNames), image_inputs("parameter-registered-twice", (4,))),
    Case("layer-scale-tied-to-bias", build(LayerScaleTiedToBias), image_inputs("layer-scale-tied-to-bias", (4,))),
    # weights computed by a parametrization with trainable parameters of its own, on layers with call rules
    Case("attention-low-rank-parametrization", build(ParametrizedAttention),
         image_inputs("attention-low-rank-parametrization", (4, 6))),
    Case("lstm-low-rank-parametrization", build(ParametrizedLSTM),
         image_inputs("lstm-low-rank-parametrization", (4, 6))),
    Case("cls-token-and-position-parameters", build(ClsTokenNet),
         image_inputs("cls-token-and-position-parameters", (4, 4))),
    # a layer that sees (1, T): its (1, T, D) output goes downstream as per-sample copies (engine.broadcast)
    Case("positional-embedding", build(PositionalEmbeddingNet), token_inputs("positional-embedding", 5, 9)),
    # refused by every strategy: BatchNorm with batch statistics
    Case("batchnorm2d-train", build(_bn_net, "train"), image_inputs("batchnorm2d-train", (2, 4, 4)),
         expect="refuse"),
    # adversarial --------------------------------------------------------------------------------------
    # the samples along dimension 1 of a layer (T == B): the probe finds it, the Linear rule takes them moved first
    Case("sequence-first-linear-B2-T2", build(SequenceFirstLinear), image_inputs("sequence-first", (2, 3)),
         expect="hooks", batches=(2,)),
    # first a batch of 1 (where (1, T) is batch-first), then 3 on the same model: no stale per-model cache
    Case("positional-embedding-B1-then-B3", build(PositionalEmbeddingNet),
         token_inputs("positional-embedding-B1-then-B3", 5, 9), batches=(1, 3)),
    _rnn("gru-head-on-full-h_n-B2-layers2", nn.GRU, "h_n_all", expect="hooks", batches=(2,)),
    _rnn("lstm-head-on-full-h_n-B1-then-B2", nn.LSTM, "h_n_all", expect="hooks", batches=(1, 2)),
    # an RNN on a PackedSequence: the packed tokens of all samples share one dimension
    Case("lstm-packed-sequence", build(lambda: PackedRNN(nn.LSTM, False)), token_inputs("lstm-packed", 5, 9),
         expect="torch_func"),
    Case("gru-bidirectional-packed-sequence", build(lambda: PackedRNN(nn.GRU, True)),
         token_inputs("gru-packed", 5, 9), expect="torch_func"),
    Case("batch-centering", build(BatchCentering), image_inputs("batch-centering", (4,)), expect="torch_func"),
    Case("rows-after-reshape", build(RowsNet), image_inputs("rows-after-reshape", (3, 4)), expect="torch_func"),
    # losses: resolve_strategy does not see them, the per-sample losses must still be the loop's
    Case("mse-output-Bx1-target-B", build(_mlp(1)), _regression_inputs("mse-broadcast", ()),
         loss_fns={"mse-mean": nn.MSELoss, "mse-sum": lambda: nn.MSELoss(reduction="sum")}, jacobian=False),
    Case("loss-divides-by-batch", build(_mlp(2)), _regression_inputs("loss-divides-by-batch", (2,)),
         loss_fns={"sum-over-batch-size": _loss_divided_by_batch}, jacobian=False),
]

BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "case names must be unique"
