"""Where the full Fashion-MNIST is found, in this order: a folder you name (an argument, or ``$PERGRAD_VIZ_DATA``),
the checkout's ``data/`` (``make data`` fills it), Debian's ``/usr/share/datasets/fashion-mnist``; else the bundled
1,000 + 1,000 sample. Each holds the original gzip-compressed IDX files; ``load_sample`` reads its first ``n``
images from them directly, ``fashion_mnist()`` (the whole set, for scans) from a copy in torchvision's layout,
decompressed once into ``$PERGRAD_VIZ_CACHE`` (default ``~/.cache/pergrad_viz``)."""

from __future__ import annotations

import gzip
import os
import shutil
from pathlib import Path

__all__ = ["DATA_ENV", "DEBIAN_SOURCE", "FILES", "cache_root", "checkout_data", "find_fashion_mnist",
           "full_fashion_mnist_root"]

DEBIAN_SOURCE = Path("/usr/share/datasets/fashion-mnist")
"""Where Debian's ``dataset-fashion-mnist`` package puts the gzip-compressed IDX files."""

DATA_ENV = "PERGRAD_VIZ_DATA"
"""A data folder like the checkout's ``data/``: the full Fashion-MNIST in ``$PERGRAD_VIZ_DATA/fashion-mnist/``."""

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def checkout_data() -> Path | None:
    """The ``data/`` folder of the checkout this package runs from, or None for an installed package."""
    top = Path(__file__).resolve().parents[2]
    return top / "data" if (top / "pyproject.toml").is_file() and (top / "pergrad_viz").is_dir() else None


def _complete(folder: Path) -> bool:
    return all((folder / f"{name}.gz").is_file() for name in FILES)


def find_fashion_mnist() -> Path | None:
    """The first folder holding the four gzip-compressed files: ``$PERGRAD_VIZ_DATA/fashion-mnist``, the checkout's
    ``data/fashion-mnist``, :data:`DEBIAN_SOURCE`; None when none does (use the bundled sample)."""
    candidates = []
    if os.environ.get(DATA_ENV):
        candidates.append(Path(os.environ[DATA_ENV]).expanduser() / "fashion-mnist")
    if (data := checkout_data()) is not None:
        candidates.append(data / "fashion-mnist")
    candidates.append(DEBIAN_SOURCE)
    return next((folder for folder in candidates if _complete(folder)), None)


def cache_root() -> Path:
    """The folder the decompressed files go to: ``$PERGRAD_VIZ_CACHE`` or ``~/.cache/pergrad_viz``."""
    return Path(os.environ.get("PERGRAD_VIZ_CACHE", "~/.cache/pergrad_viz")).expanduser()


def full_fashion_mnist_root(source: Path = DEBIAN_SOURCE) -> Path | None:
    """A torchvision-style root (``ROOT/FashionMNIST/raw/``) holding the full Fashion-MNIST, decompressing
    ``source/*.gz`` into the cache on first use (again when a file changes), or None when ``source`` lacks them."""
    if not _complete(source):
        return None
    root = cache_root() / "fashion-mnist"
    try:
        _decompress(source, root / "FashionMNIST" / "raw")
    except OSError as e:  # a home folder one cannot write (a service account, a read-only container)
        raise type(e)(f"cannot write the decompressed Fashion-MNIST (about 55 MB) into {root} ({e}): set "
                      "PERGRAD_VIZ_CACHE to a folder you can write, e.g. PERGRAD_VIZ_CACHE=/tmp/pergrad_viz") from e
    return root


def _decompress(source: Path, raw: Path) -> None:
    """``source/*.gz`` decompressed into ``raw``, each file again only where its source changed."""
    gz = [source / f"{name}.gz" for name in FILES]
    raw.mkdir(parents=True, exist_ok=True)
    for src, name in zip(gz, FILES, strict=True):
        dst = raw / name
        stamp = raw / f".{name}.from"
        key = f"{src.resolve()} {src.stat().st_size} {src.stat().st_mtime_ns}"
        if dst.is_file() and stamp.is_file() and stamp.read_text() == key:
            continue
        tmp = raw / f".{name}.{os.getpid()}.tmp"
        with gzip.open(src, "rb") as fin, tmp.open("wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        os.replace(tmp, dst)
        stamp.write_text(key)
