"""Finding mislabelled examples by per-sample gradient norm: the pieces of the experiment.

Flip a known fraction of labels (seeded), train briefly, rank samples by the norm of their loss gradient
(large: the model is being pulled hard by that example, as mislabelled ones do), and measure how many
flipped labels the top of the ranking catches (precision at k) against what a random ranking catches.
"""

from __future__ import annotations

import torch
from torch import nn


def flip_labels(labels: torch.Tensor, fraction: float, n_classes: int, *, seed: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Give ``round(fraction * N)`` randomly chosen samples a different, random class.

    Args:
        labels: (N,) int64 class indices.
        fraction: in [0, 1].
    Returns:
        (noisy labels (N,), flipped mask (N,) bool). Every flipped label differs from the original.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be between 0 and 1, got {fraction}")
    if n_classes < 2:
        raise ValueError(f"flipping needs at least 2 classes, got n_classes={n_classes}")
    gen = torch.Generator().manual_seed(seed)
    n = labels.shape[0]
    chosen = torch.randperm(n, generator=gen)[: round(fraction * n)]
    shift = torch.randint(1, n_classes, (chosen.numel(),), generator=gen)  # never 0: always another class
    noisy = labels.clone()
    noisy[chosen] = (labels[chosen] + shift.to(labels.device)) % n_classes
    flipped = torch.zeros(n, dtype=torch.bool, device=labels.device)
    flipped[chosen] = True
    return noisy, flipped


def train(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor, *, epochs: int = 10, batch_size: int = 64,
          lr: float = 0.05, seed: int = 0) -> list[float]:
    """Plain SGD with cross-entropy, seeded shuffling; trains ``model`` in place, returns the epoch losses.

    inputs (N, ...), labels (N,). The model is left in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    history = []
    for _ in range(epochs):
        order = torch.randperm(inputs.shape[0], generator=gen)
        total = 0.0
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            opt.zero_grad()
            loss = loss_fn(model(inputs[idx]), labels[idx])
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        history.append(total / inputs.shape[0])
    model.eval()
    return history


def precision_at_k(scores: torch.Tensor, relevant: torch.Tensor, k: int) -> float:
    """Fraction of the ``k`` highest ``scores`` (N,) that are ``relevant`` (N,) bool."""
    if not 1 <= k <= scores.shape[0]:
        raise ValueError(f"k must be between 1 and N={scores.shape[0]}, got {k}")
    top = torch.topk(scores, k).indices
    return relevant[top].float().mean().item()


def random_precision(relevant: torch.Tensor) -> float:
    """What a random ranking's precision at any k is in expectation: the share of relevant samples."""
    return relevant.float().mean().item()
