"""A PyTorch bug the definition runs into (pergrad_viz.core.norm_grads): on CPUs, batch norm's backward (BatchNorm
with running statistics, InstanceNorm) on a batch of one gives wrong gradients when its output gradient arrives with
channels-last strides, as from ``x.flatten(2).transpose(1, 2)`` (XCiT's and LeViT's patch embedding). Every strategy,
the loop (the definition) included, and the DP sum under the defaults must give each sample's true gradient: here
computed by plain autograd on a batch of two copies of the sample (the kernel is right on two samples; eval-mode
batch norm keeps them apart), checked once against central differences."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pergrad_viz as pv

DT = torch.float64
B = 3


class Tokens(nn.Module):
    """A convolution, a norm, then the feature map read as tokens (B, H * W, C) and averaged."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.norm(self.conv(x)).flatten(2).transpose(1, 2).mean(1))


NORMS = {"batch norm": lambda: nn.BatchNorm2d(4), "instance norm": lambda: nn.InstanceNorm2d(4, affine=True)}


def _model(norm: str) -> nn.Module:
    torch.manual_seed(0)
    model = Tokens(NORMS[norm]()).to(DT).eval()
    if isinstance(model.norm, nn.BatchNorm2d):
        with torch.no_grad():
            model.norm.running_mean.uniform_(-0.5, 0.5)
            model.norm.running_var.uniform_(0.5, 2.0)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(B, 3, 4, 4, generator=gen, dtype=DT), torch.tensor([0, 1, 2])


LOSS = nn.CrossEntropyLoss(reduction="sum")


def _true_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sample i's gradient as half the gradient of two copies of it (a batch of two: the kernel is right there)."""
    rows = []
    for i in range(B):
        pair = torch.cat([x[i:i + 1]] * 2)
        grads = torch.autograd.grad(LOSS(model(pair), y[i:i + 1].repeat(2)) / 2, list(model.parameters()))
        rows.append(grads)
    return {n: torch.stack([r[k] for r in rows]) for k, (n, _) in enumerate(model.named_parameters())}


@pytest.mark.parametrize("norm", list(NORMS))
def test_the_reference_is_the_gradient_and_plain_autograd_on_one_sample_is_not(norm: str) -> None:
    model, (x, y) = _model(norm), _data()
    want = _true_grads(model, x, y)["norm.bias"][0]
    bias = model.norm.bias
    numeric = torch.empty_like(bias)
    for c in range(bias.numel()):
        losses = []
        for step in (1e-6, -1e-6):
            with torch.no_grad():
                bias[c] += step
                losses.append(LOSS(model(x[:1]), y[:1]).item())
                bias[c] -= step
        numeric[c] = (losses[0] - losses[1]) / 2e-6
    torch.testing.assert_close(want, numeric, rtol=1e-6, atol=1e-8)
    plain = torch.autograd.grad(LOSS(model(x[:1]), y[:1]), [bias])[0]  # PyTorch's own, one sample: off
    assert not torch.allclose(plain, numeric, rtol=1e-3, atol=1e-5), "PyTorch fixed it: core/norm_grads.py may go"


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("strategy", ["loop", "hooks", "torch_func", "auto"])
def test_every_strategy_gives_each_samples_true_gradient(norm: str, strategy: str) -> None:
    model, (x, y) = _model(norm), _data()
    want = _true_grads(model, x, y)
    got = pv.per_sample_grads(model, LOSS, x, y, strategy=strategy)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    assert not model.norm._forward_hooks and not model.conv._forward_hooks  # the workaround's hooks are gone


@pytest.mark.parametrize("norm", list(NORMS))
def test_the_clipped_sum_under_the_defaults_is_the_true_one(norm: str) -> None:
    model, (x, y) = _model(norm), _data()
    want = _true_grads(model, x, y)
    flat = torch.cat([g.reshape(B, -1) for g in want.values()], 1)
    norms = flat.norm(dim=1)
    bound = float(norms.median())
    c = (bound / (norms + 1e-6)).clamp(max=1.0)
    got = pv.clipped_grad_sum(model, LOSS, x, y, bound)
    for name, w in want.items():
        torch.testing.assert_close(got[name], torch.einsum("b,b...->...", c, w), rtol=1e-9, atol=1e-12,
                                   msg=lambda m, name=name: f"{name}: {m}")


class Image(nn.Module):
    """A convolution and a norm on a channels_last image, flattened: the norm's input is channels-last, the output
    gradient arrives contiguous (through the hooked pass's alias of the output)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = norm
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.norm(self.conv(x))).flatten(1))


def _image_model() -> nn.Module:
    torch.manual_seed(0)
    model = Image(nn.BatchNorm2d(4)).to(DT).eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


@pytest.mark.parametrize("chunk_size", [None, 1, 2])
@pytest.mark.parametrize("strategy", ["loop", "hooks", "torch_func", "auto"])
def test_a_channels_last_image_in_chunks_of_one_gives_the_true_gradient(strategy: str, chunk_size: int | None) -> None:
    model, (x, y) = _image_model(), _data()
    x = x.contiguous(memory_format=torch.channels_last)
    want = _true_grads(model, x, y)
    got = pv.per_sample_grads(model, LOSS, x, y, strategy=strategy, chunk_size=chunk_size, verify=False)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"{name}: {m}")
    flat = torch.cat([g.reshape(B, -1) for g in want.values()], 1)
    norms = flat.norm(dim=1)
    torch.testing.assert_close(pv.per_sample_grad_norms(model, LOSS, x, y, chunk_size=chunk_size, verify=False), norms)
    c = (float(norms.median()) / (norms + 1e-6)).clamp(max=1.0)
    got = pv.clipped_grad_sum(model, LOSS, x, y, float(norms.median()), chunk_size=chunk_size, verify=False)
    for name, w in want.items():
        torch.testing.assert_close(got[name], torch.einsum("b,b...->...", c, w), rtol=1e-9, atol=1e-12)
