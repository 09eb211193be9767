"""The networks from the tutorial, plus a small CNN.

* :class:`MLP` – ``MLP(784, 20, 10)``: Linear -> ReLU -> Linear on flattened 28x28 images.
* :func:`bias_free_net` – the bias-free ``2 -> 16 -> 2`` network of the classic per-sample gradient question.
* :class:`SmallCNN` – two convolutions (stride, padding, groups) and GroupNorm, for 1x28x28 images.
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
    """

    def __init__(self, n_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=3, padding=1)
        self.norm1 = nn.GroupNorm(2, 8)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=3, stride=2, padding=1, groups=2)
        self.head = nn.Linear(16, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            x = x.view(-1, 1, 28, 28)
        x = torch.relu(self.norm1(self.conv1(x)))
        x = torch.relu(self.conv2(x))
        return self.head(x.mean(dim=(2, 3)))
