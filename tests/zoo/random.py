"""Forwards that draw random numbers (issue 28), as people write them: timm's stochastic depth (``drop_path_rate``)
in training mode, ``F.dropout(..., training=True)`` whatever the mode, Gaussian noise added in the forward. Every
strategy and ``auto`` refuse with ``UndefinedPerSampleError`` and draw nothing from the caller's generator.

Each case: ``(name, make_model, make_inputs, optional package)``; inputs (B, ...) and (B,) labels of 3 classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DT = torch.float64


class AlwaysDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(F.dropout(torch.tanh(self.fc(x)), p=0.2, training=True))


class Noisy(nn.Module):
    """Noise on the features, in eval mode too (a regulariser written into forward)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        h = self.fc(x)
        return self.head(h + 0.1 * torch.randn_like(h))


def _plain(cls):
    def make():
        torch.manual_seed(0)
        return cls().to(DT).eval()
    return make


def _timm_vit():
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=3, img_size=16, patch_size=8,
                              in_chans=3, embed_dim=16, depth=2, num_heads=2, drop_path_rate=0.5)
    return model.to(DT).train()


def _floats(*shape):
    def make(batch):
        g = torch.Generator().manual_seed(21)
        return torch.randn(batch, *shape, generator=g, dtype=DT), torch.randint(0, 3, (batch,), generator=g)
    return make


CASES = [
    ("timm-vit-drop-path", _timm_vit, _floats(3, 16, 16), "timm"),
    ("f-dropout-training-true", _plain(AlwaysDropout), _floats(4), ""),
    ("noise-in-forward", _plain(Noisy), _floats(4), ""),
]
