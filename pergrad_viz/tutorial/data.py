"""Small real data for the examples: Fashion-MNIST (the full set where it is found, else the bundled sample), or
MNIST when it is present.

The package ships the first 1,000 training and first 1,000 test images of Fashion-MNIST as package data,
in ``pergrad_viz/tutorial/sample/FashionMNIST/raw/`` (uncompressed IDX files, built by
``python -m pergrad_viz.tutorial.sample.make_sample``;
see ``pergrad_viz/tutorial/sample/README.md``). :func:`load_sample` reads IDX files in torchvision's layout
(``ROOT/FashionMNIST/raw/``, ``ROOT/MNIST/raw/``; :mod:`.idx`, torchvision is not needed) and returns normalised
float tensors, ready to feed a model::

    X, y = load_sample(256)                   # X: (256, 784) float32, y: (256,) int64
    X, y = load_sample(64, flatten=False)     # X: (64, 1, 28, 28)

By default Fashion-MNIST comes from the full set where :mod:`.locate` finds it (``$PERGRAD_VIZ_DATA``, the
checkout's ``data/`` after ``make data``, Debian's package), else from :data:`DEFAULT_ROOT`, the sample's folder
inside the package, found from this file's location: the call works from a checkout or a ``pip install``, from
``notebooks/``, from the tests or from any other working directory, and gives the same first 1,000 images either
way. A relative ``root`` you pass yourself is taken relative to the current working directory, as usual.
"""

from __future__ import annotations

import functools
import operator
import os
from pathlib import Path

import torch

from pergrad_viz.core.extras import require
from pergrad_viz.tutorial.idx import read_idx
from pergrad_viz.tutorial.locate import find_fashion_mnist
from pergrad_viz.tutorial.sample import ROOT as SAMPLE_ROOT

__all__ = ["CLASS_NAMES", "DATASETS", "DEFAULT_ROOT", "MEAN_STD", "clear_cache", "load_sample", "read_split"]

DEFAULT_ROOT: Path = SAMPLE_ROOT
"""The bundled sample's root, ``pergrad_viz/tutorial/sample/`` (holds ``FashionMNIST/raw/``), independent of the working
directory and installed with the package."""

MAKE_SAMPLE = "python -m pergrad_viz.tutorial.sample.make_sample"
"""The command that (re)builds a Fashion-MNIST sample from Debian's ``dataset-fashion-mnist``; works from any
directory wherever the package is installed."""

DATASETS: tuple[str, ...] = ("fashion-mnist", "mnist")
"""Valid values of ``load_sample(dataset=...)``."""

CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "fashion-mnist": (
        "T-shirt/top",
        "Trouser",
        "Pullover",
        "Dress",
        "Coat",
        "Sandal",
        "Shirt",
        "Sneaker",
        "Bag",
        "Ankle boot",
    ),
    "mnist": ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9"),
}
"""Class names by label (index ``y``) for each dataset."""

MEAN_STD: dict[str, tuple[float, float]] = {
    "fashion-mnist": (0.2860, 0.3530),
    "mnist": (0.1307, 0.3081),
}
"""The standard per-pixel mean and standard deviation (of ``x / 255`` over the full training set)."""

# torchvision's class for each dataset; its __name__ is the folder under root (ROOT/FashionMNIST/raw/).
_TORCHVISION_CLASS = {"fashion-mnist": "FashionMNIST", "mnist": "MNIST"}

# The uncompressed IDX files torchvision requires in ROOT/<Class>/raw/ (all four, whichever split is read).
_RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
# torchvision's legacy cache, which it also accepts instead of the raw files.
_LEGACY_FILES = ("training.pt", "test.pt")


def _download(dataset: str, root: Path, train: bool) -> None:
    torchvision = require("torchvision", "load_sample(download=True)")
    getattr(torchvision.datasets, _TORCHVISION_CLASS[dataset])(root=str(root), train=train, download=True)


def missing_files(dataset: str, root: Path) -> list[Path]:
    """The raw files torchvision needs that are absent (empty when the dataset can be read)."""
    folder = root / _TORCHVISION_CLASS[dataset]
    if all((folder / "processed" / name).is_file() for name in _LEGACY_FILES):
        return []
    return [folder / "raw" / name for name in _RAW_FILES if not (folder / "raw" / name).is_file()]


def _not_found(dataset: str, root: Path, missing: list[Path]) -> FileNotFoundError:
    raw = root / _TORCHVISION_CLASS[dataset] / "raw"
    names = ", ".join(p.name for p in missing) if missing else "the IDX files"
    if dataset == "fashion-mnist":
        fix = (
            f"rebuild the sample with `{MAKE_SAMPLE} --root {root}` "
            "(reads Debian's dataset-fashion-mnist), pass download=True on a machine with internet, "
            f"or put the uncompressed IDX files under {raw}/"
        )
    else:
        fix = f"pass download=True on a machine with internet, or put the uncompressed IDX files under {raw}/"
    return FileNotFoundError(f"{dataset} not found under {root} (missing in {raw}: {names}). To fix: {fix}.")


@functools.lru_cache(maxsize=8)
def _load_uint8(
    dataset: str, root: str, train: bool, limit: int | None, stamp: tuple[tuple[str, int, int], ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` (or all) images (N, 28, 28) uint8 and labels (N,) int64 of one split; cached.

    ``stamp`` (names, sizes and modification times of the files) is part of the cache key only, so that
    rebuilt files are read again. The returned tensors are shared by every caller: never mutate them.
    """
    del stamp
    folder = Path(root) / _TORCHVISION_CLASS[dataset]
    legacy = folder / "processed" / _LEGACY_FILES[0 if train else 1]
    try:
        if all((folder / "processed" / name).is_file() for name in _LEGACY_FILES):  # torchvision's old cache
            images, labels = torch.load(legacy, weights_only=True)
            return images[:limit], labels[:limit]
        prefix = "train" if train else "t10k"
        images = read_idx(folder / "raw" / f"{prefix}-images-idx3-ubyte", limit)
        labels = read_idx(folder / "raw" / f"{prefix}-labels-idx1-ubyte", limit)
    except FileNotFoundError as exc:  # the files vanished since the check
        raise _not_found(dataset, Path(root), []) from exc
    return images, labels.to(torch.int64)


def read_split(dataset: str, root: Path, train: bool, limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` (or all) images (N, 28, 28) uint8 and labels (N,) int64 of a split under a
    torchvision-style ``root`` (``ROOT/FashionMNIST/raw/``), read once and cached: never mutate them.

    Raises:
        FileNotFoundError: files are missing (the message names the fix).
    """
    missing = missing_files(dataset, root)
    if missing:
        raise _not_found(dataset, root, missing)
    return _load_uint8(dataset, str(root), train, limit, _stamp(dataset, root))


@functools.lru_cache(maxsize=8)
def _load_gz(folder: str, train: bool, limit: int, stamp: tuple[tuple[int, int], ...]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``limit`` images and labels of a split from a folder of gzip-compressed IDX files (Debian's
    layout); cached like :func:`_load_uint8` (``stamp``: the files' sizes and modification times)."""
    del stamp
    prefix = "train" if train else "t10k"
    images = read_idx(Path(folder) / f"{prefix}-images-idx3-ubyte.gz", limit)
    labels = read_idx(Path(folder) / f"{prefix}-labels-idx1-ubyte.gz", limit)
    return images, labels.to(torch.int64)


def _read_full(source: Path, train: bool, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    prefix = "train" if train else "t10k"
    files = [source / f"{prefix}-{kind}-idx{d}-ubyte.gz" for kind, d in (("images", 3), ("labels", 1))]
    return _load_gz(str(source), train, limit, tuple((f.stat().st_size, f.stat().st_mtime_ns) for f in files))


def _stamp(dataset: str, root: Path) -> tuple[tuple[str, int, int], ...]:
    folder = root / _TORCHVISION_CLASS[dataset]
    out = []
    for path in sorted(folder.glob("*/*")):
        if path.is_file():
            st = path.stat()
            out.append((str(path.relative_to(folder)), st.st_size, st.st_mtime_ns))
    return tuple(out)


def clear_cache() -> None:
    """Forget the images cached by :func:`load_sample` (they are re-read on the next call)."""
    _load_uint8.cache_clear()
    _load_gz.cache_clear()


def load_sample(
    n: int = 1000,
    train: bool = True,
    dataset: str = "fashion-mnist",
    root: str | os.PathLike[str] | None = None,
    flatten: bool = True,
    download: bool = False,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` images and labels of a split, normalised, as tensors.

    Args:
        n: how many images, taken in file order (the first ``n``; deterministic). The bundled sample
            holds 1,000 per split; build a bigger one with
            ``python -m pergrad_viz.tutorial.sample.make_sample --n-train N --n-test N [--root DIR]``.
        train: the training split (``train-*`` files) if true, else the test split (``t10k-*``).
        dataset: ``"fashion-mnist"`` (bundled) or ``"mnist"`` (used when present under ``ROOT/MNIST/raw/``,
            or fetched with ``download=True``).
        root: a dataset root in torchvision's layout (``ROOT/FashionMNIST/raw/``, ``ROOT/MNIST/raw/``). By
            default, for Fashion-MNIST, the full dataset where :func:`~.locate.find_fashion_mnist` finds it
            (``$PERGRAD_VIZ_DATA``, the checkout's ``data/`` after ``make data``, Debian's package), else
            :data:`DEFAULT_ROOT`, the bundled sample inside the package (whose images are the full dataset's first
            1,000 of each split: the same values for ``n <= 1000``); for MNIST, :data:`DEFAULT_ROOT`.
        flatten: return ``X`` as ``(n, 784)`` if true, else as ``(n, 1, 28, 28)``.
        download: passed to torchvision: fetch the full dataset into ``root`` when absent (needs internet).
        device: where to put both tensors (default: CPU).
        dtype: floating dtype of ``X``.

    Returns:
        ``(X, y)``: ``X`` of shape ``(n, 784)`` (or ``(n, 1, 28, 28)``) and dtype ``dtype``, equal to
        ``(x / 255 - mean) / std`` with the dataset's standard :data:`MEAN_STD` (Fashion-MNIST
        0.2860 / 0.3530, MNIST 0.1307 / 0.3081), so roughly zero-mean and unit-variance; ``y`` of shape
        ``(n,)`` and dtype ``torch.int64`` with labels in ``0..9`` (names in :data:`CLASS_NAMES`).
        Both are fresh tensors on every call (the files are read once and cached), so callers may
        mutate them.

    Raises:
        ValueError: ``dataset`` is unknown, ``n < 1``, ``n`` exceeds the images available, or ``dtype`` is
            not a floating dtype.
        TypeError: ``n`` is not an integer.
        FileNotFoundError: the dataset's files are absent from ``root`` (the message names the fix).
    """
    if dataset not in _TORCHVISION_CLASS:
        valid = ", ".join(repr(d) for d in DATASETS)
        raise ValueError(f"unknown dataset {dataset!r}; valid datasets: {valid}")
    n = operator.index(n)
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating dtype (e.g. torch.float32), got {dtype}")

    source = find_fashion_mnist() if root is None and dataset == "fashion-mnist" else None
    if source is not None:  # the full set: its first n + 1 images straight from the .gz files (no decompressed copy)
        images, labels = _read_full(source, train, n + 1)
        if n > images.shape[0]:
            raise ValueError(f"n={n} but the full Fashion-MNIST in {source} has only {images.shape[0]} "
                             f"{'training' if train else 'test'} images")
        return _normalised(dataset, images[:n], labels[:n], flatten, device, dtype)
    root_path = Path(DEFAULT_ROOT if root is None else root).expanduser().resolve()
    if download:
        # torchvision skips the download when the files are there already.
        _download(dataset, root_path, train)
    images, labels = read_split(dataset, root_path, train, n + 1)  # one more: was n too many?
    available = images.shape[0]
    if n > available:
        split, flag = ("training", "--n-train") if train else ("test", "--n-test")
        raw = root_path / _TORCHVISION_CLASS[dataset] / "raw"
        if dataset == "fashion-mnist":
            fix = f"rebuild a bigger sample with `{MAKE_SAMPLE} {flag} {n} --root {root_path}`"
            if root_path == DEFAULT_ROOT:  # a sample of one's own, not the package's files rewritten
                fix = (f"run `make data` in a checkout (or `apt-get install dataset-fashion-mnist`), or build a "
                       f"bigger sample of your own with `{MAKE_SAMPLE} {flag} {n} --root DIR` and pass root='DIR'")
        else:
            fix = f"put the full MNIST IDX files under {raw}/ (or pass download=True with internet access)"
        raise ValueError(
            f"n={n} but only {available} {split} images are available in {raw}; to use more, {fix}."
        )

    return _normalised(dataset, images[:n], labels[:n], flatten, device, dtype)


def _normalised(dataset: str, images: torch.Tensor, labels: torch.Tensor, flatten: bool,
                device: torch.device | str | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 784) or (n, 1, 28, 28) floats ``(x / 255 - mean) / std`` and (n,) int64 labels, fresh copies."""
    n = images.shape[0]
    mean, std = MEAN_STD[dataset]
    x = images.to(device=device, dtype=dtype)  # a copy: uint8 -> float
    x = x.div_(255.0).sub_(mean).div_(std)
    x = x.reshape(n, 784) if flatten else x.reshape(n, 1, 28, 28)
    y = labels.to(device=device, dtype=torch.int64, copy=True)
    return x, y
