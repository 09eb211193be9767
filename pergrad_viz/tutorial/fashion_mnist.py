"""Fashion-MNIST as a ``torch.utils.data.Dataset`` for whole-dataset scans: the full 60,000 + 10,000 images (the
checkout's ``data/`` after ``make data``, ``$PERGRAD_VIZ_DATA``, or Debian's ``dataset-fashion-mnist`` package:
:mod:`.locate` says where it looks), or the bundled 1,000 + 1,000 sample when none holds them.

The full dataset comes as the original gzip-compressed IDX files; they are decompressed once into a cache,
``$PERGRAD_VIZ_CACHE`` (default ``~/.cache/pergrad_viz``), and read from there (:mod:`.idx`, no torchvision).

>>> ds = fashion_mnist("train")          # items: x (1, 28, 28) float32 normalised, y int64 in 0..9
>>> len(ds)                              # 60000 with the full dataset, 1000 without it
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Literal

import torch

from pergrad_viz.tutorial.data import DEFAULT_ROOT, MEAN_STD, read_split
from pergrad_viz.tutorial.locate import DEBIAN_SOURCE, cache_root, find_fashion_mnist, full_fashion_mnist_root

__all__ = ["DEBIAN_SOURCE", "FIND", "cache_root", "fashion_mnist", "full_fashion_mnist_root"]

FIND: Literal["find"] = "find"
"""``fashion_mnist(source=FIND)``, the default: the first place :func:`~.locate.find_fashion_mnist` finds."""


def fashion_mnist(split: str = "train", *, limit: int | None = None, source: Path | str | None = FIND,
                  quiet: bool = False) -> torch.utils.data.TensorDataset:
    """Fashion-MNIST images and labels as a ``TensorDataset`` of ``x`` (1, 28, 28) float32, normalised as
    ``(x / 255 - 0.2860) / 0.3530``, and ``y`` int64, in file order.

    Args:
        split: ``"train"`` (60,000 images, or the bundled 1,000) or ``"test"`` (10,000, or the bundled 1,000).
        limit: keep the first ``limit`` examples.
        source: a folder with the gzip-compressed IDX files (as Debian's); :data:`FIND` (the default) for the first
            of ``$PERGRAD_VIZ_DATA/fashion-mnist``, the checkout's ``data/fashion-mnist``, Debian's folder; None for
            the bundled sample.
        quiet: do not print the note when falling back to the bundled sample.

    Raises:
        ValueError: an unknown split or a bad ``limit``.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be a positive int, got {limit!r}")
    searched = source == FIND
    if searched:
        source = find_fashion_mnist()
    root = None if source is None else full_fashion_mnist_root(Path(source))
    if root is None:
        root = DEFAULT_ROOT
        if not quiet and (searched or source is not None):
            where = "in data/, $PERGRAD_VIZ_DATA or " + str(DEBIAN_SOURCE) if searched else f"in {source}"
            print(f"note: the full Fashion-MNIST is not installed (no IDX files {where}; `make data` or "
                  "`apt-get install dataset-fashion-mnist` installs it): using the bundled sample of 1,000 "
                  f"{split} images in {DEFAULT_ROOT}", file=sys.stderr)
    images, labels = read_split("fashion-mnist", root, split == "train", limit)  # (N, 28, 28) uint8, (N,) int64
    mean, std = MEAN_STD["fashion-mnist"]
    x = images.unsqueeze(1).to(torch.float32).div_(255).sub_(mean).div_(std)
    return torch.utils.data.TensorDataset(x, labels.clone())  # a copy: the cached labels are shared
