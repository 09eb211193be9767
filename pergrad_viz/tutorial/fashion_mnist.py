"""Fashion-MNIST as a ``torch.utils.data.Dataset`` for whole-dataset scans: the full 60,000 + 10,000 images from
Debian's ``dataset-fashion-mnist`` package, or the bundled 1,000 + 1,000 sample when that is absent.

The Debian package installs the original gzip-compressed IDX files in ``/usr/share/datasets/fashion-mnist/``
(``make data`` installs it with apt-get). torchvision's ``FashionMNIST`` class reads the *uncompressed* files
from ``ROOT/FashionMNIST/raw/``, so they are decompressed once into a cache, ``$PERGRAD_VIZ_CACHE`` (default
``~/.cache/pergrad_viz``), and read from there by ``torchvision.datasets.FashionMNIST``.

>>> ds = fashion_mnist("train")          # items: x (1, 28, 28) float32 normalised, y int64 in 0..9
>>> len(ds)                              # 60000 with the Debian package, 1000 without it
"""

from __future__ import annotations

import gzip
import os
import shutil
import sys
from pathlib import Path

import torch

from pergrad_viz.tutorial.data import DEFAULT_ROOT, MEAN_STD

__all__ = ["DEBIAN_SOURCE", "cache_root", "fashion_mnist", "full_fashion_mnist_root"]

DEBIAN_SOURCE = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package puts the gzip-compressed IDX files."""

_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def cache_root() -> Path:
    """The folder the decompressed files go to: ``$PERGRAD_VIZ_CACHE`` or ``~/.cache/pergrad_viz``."""
    return Path(os.environ.get("PERGRAD_VIZ_CACHE", "~/.cache/pergrad_viz")).expanduser()


def full_fashion_mnist_root(source: Path = DEBIAN_SOURCE) -> Path | None:
    """A torchvision root holding the full Fashion-MNIST (decompressing ``source/*.gz`` into the cache on first
    use), or None when ``source`` lacks the files."""
    gz = [source / f"{name}.gz" for name in _FILES]
    if not all(p.is_file() for p in gz):
        return None
    root = cache_root() / "fashion-mnist"
    raw = root / "FashionMNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for src, name in zip(gz, _FILES, strict=True):
        dst = raw / name
        stamp = raw / f".{name}.from"
        key = f"{src} {src.stat().st_size} {src.stat().st_mtime_ns}"
        if dst.is_file() and stamp.is_file() and stamp.read_text() == key:
            continue
        tmp = raw / f".{name}.{os.getpid()}.tmp"
        with gzip.open(src, "rb") as fin, tmp.open("wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        os.replace(tmp, dst)
        stamp.write_text(key)
    return root


def fashion_mnist(split: str = "train", *, limit: int | None = None, source: Path | None = DEBIAN_SOURCE,
                  quiet: bool = False) -> torch.utils.data.TensorDataset:
    """Fashion-MNIST images and labels as a ``TensorDataset`` of ``x`` (1, 28, 28) float32, normalised as
    ``(x / 255 - 0.2860) / 0.3530``, and ``y`` int64, in file order.

    Args:
        split: ``"train"`` (60,000 images, or the bundled 1,000) or ``"test"`` (10,000, or the bundled 1,000).
        limit: keep the first ``limit`` examples.
        source: the folder with Debian's gzip-compressed IDX files; None for the bundled sample.
        quiet: do not print the note when falling back to the bundled sample.

    Raises:
        ValueError: an unknown split or a bad ``limit``.
    """
    import torchvision  # slow to import: only here

    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = None if source is None else full_fashion_mnist_root(Path(source))
    if root is None:
        root = DEFAULT_ROOT
        if not quiet and source is not None:
            print(f"note: the full Fashion-MNIST is not installed ({source} has no IDX files; `make data` or "
                  "`apt-get install dataset-fashion-mnist` installs it): using the bundled sample of 1,000 "
                  f"{split} images in {DEFAULT_ROOT}", file=sys.stderr)
    ds = torchvision.datasets.FashionMNIST(root=str(root), train=split == "train", download=False)
    images, labels = ds.data, ds.targets  # (N, 28, 28) uint8, (N,) int64
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        images, labels = images[:limit], labels[:limit]
    mean, std = MEAN_STD["fashion-mnist"]
    x = images.unsqueeze(1).to(torch.float32).div_(255).sub_(mean).div_(std)
    return torch.utils.data.TensorDataset(x, labels.to(torch.int64))
