#!/usr/bin/env python3
"""Build the small bundled Fashion-MNIST sample in ``pergrad_viz/tutorial/sample/FashionMNIST/raw/``.

Reads the gzip-compressed IDX files of Debian's ``dataset-fashion-mnist`` package (by default from
``/usr/share/datasets/fashion-mnist/``) and writes the FIRST ``--n-train`` training and FIRST
``--n-test`` test images and labels, uncompressed, under ``ROOT/FashionMNIST/raw/`` with the file names
``torchvision.datasets.FashionMNIST(root=ROOT, download=False)`` reads:

    train-images-idx3-ubyte   train-labels-idx1-ubyte
    t10k-images-idx3-ubyte    t10k-labels-idx1-ubyte

torchvision checks that all four exist (the compressed ``.gz`` files are not read), whichever split is
asked for. The output depends only on the source files and the counts (no timestamps, no randomness),
so rerunning the script reproduces the files byte for byte.

Usage (from any directory; ``python pergrad_viz/tutorial/sample/make_sample.py`` from a checkout does the same)::

    python -m pergrad_viz.tutorial.sample.make_sample     # 1000 + 1000, into tutorial/sample/FashionMNIST/raw/
    python -m pergrad_viz.tutorial.sample.make_sample --n-train 5000 --n-test 2000
    python -m pergrad_viz.tutorial.sample.make_sample --root DIR  # into DIR/FashionMNIST/raw/

Only the standard library and the IDX header layout are used; no torch or numpy.
"""

from __future__ import annotations

import argparse
import gzip
import struct
import sys
from pathlib import Path
from typing import BinaryIO

DEFAULT_SOURCE = Path("/usr/share/datasets/fashion-mnist")
DEFAULT_ROOT = Path(__file__).resolve().parent  # pergrad_viz/tutorial/sample/, where the bundled sample lives
FOLDER = "FashionMNIST"  # torchvision.datasets.FashionMNIST.__name__: it reads ROOT/FashionMNIST/raw/

# IDX magic numbers: two zero bytes, the element type (0x08: unsigned byte), the number of dimensions.
IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801

# (split prefix in the file names, the argparse destination holding its count)
SPLITS = (("train", "n_train"), ("t10k", "n_test"))


def _open_source(path: Path) -> BinaryIO:
    """Open ``path`` (``*.gz``), falling back to the uncompressed file of the same name without ``.gz``."""
    if path.is_file():
        return gzip.open(path, "rb")
    plain = path.with_suffix("")
    if plain.is_file():
        return plain.open("rb")
    raise FileNotFoundError(
        f"{path} not found (nor {plain.name}). Install Debian's package with "
        "`apt-get install dataset-fashion-mnist`, or pass --source DIR with the Fashion-MNIST IDX files."
    )


def _read_exact(f: BinaryIO, size: int, path: Path) -> bytes:
    data = f.read(size)
    if len(data) != size:
        raise ValueError(f"{path}: truncated IDX file (wanted {size} bytes, got {len(data)})")
    return data


def read_idx_head(path: Path, n: int, magic: int) -> tuple[tuple[int, ...], bytes]:
    """Read the first ``n`` items of an IDX file of unsigned bytes.

    Returns the item shape (``(28, 28)`` for images, ``()`` for labels) and the raw bytes of the first
    ``n`` items. Only the needed prefix of the (gzip) stream is decompressed.
    """
    with _open_source(path) as f:
        (found,) = struct.unpack(">I", _read_exact(f, 4, path))
        if found != magic:
            raise ValueError(f"{path}: IDX magic number {found:#010x}, expected {magic:#010x}")
        ndim = magic & 0xFF
        dims = struct.unpack(f">{ndim}I", _read_exact(f, 4 * ndim, path))
        total, item_shape = dims[0], tuple(dims[1:])
        if n > total:
            raise ValueError(f"{path} holds {total} items; cannot take the first {n}")
        item_size = 1
        for d in item_shape:
            item_size *= d
        return item_shape, _read_exact(f, n * item_size, path)


def write_idx(path: Path, magic: int, shape: tuple[int, ...], payload: bytes) -> None:
    """Write an uncompressed IDX file: big-endian magic, big-endian uint32 dimensions, then the bytes."""
    header = struct.pack(f">I{len(shape)}I", magic, *shape)
    path.write_bytes(header + payload)


def make_sample(source: Path, root: Path, n_train: int, n_test: int) -> list[Path]:
    """Write the first ``n_train`` / ``n_test`` images and labels under ``root/FashionMNIST/raw/``.

    Returns the paths written, in a fixed order.
    """
    counts = {"n_train": n_train, "n_test": n_test}
    for key, n in counts.items():
        if n < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be at least 1, got {n}")
    # Read everything first, so that an error (missing file, count too large) leaves no partial sample.
    outputs: list[tuple[str, int, tuple[int, ...], bytes]] = []
    for prefix, key in SPLITS:
        n = counts[key]
        for kind, magic in (("images-idx3-ubyte", IMAGES_MAGIC), ("labels-idx1-ubyte", LABELS_MAGIC)):
            name = f"{prefix}-{kind}"
            item_shape, payload = read_idx_head(source / f"{name}.gz", n, magic)
            outputs.append((name, magic, (n, *item_shape), payload))
    raw = root / FOLDER / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for name, magic, shape, payload in outputs:
        out = raw / name
        write_idx(out, magic, shape, payload)
        written.append(out)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source",
        type=Path,
        default=DEFAULT_SOURCE,
        help=f"folder with the Fashion-MNIST *-idx?-ubyte.gz files (default: {DEFAULT_SOURCE})",
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=DEFAULT_ROOT,
        help="dataset root; the files go to ROOT/FashionMNIST/raw/ (default: this script's folder, "
        "pergrad_viz/tutorial/sample/, the bundled sample)",
    )
    parser.add_argument("--n-train", type=int, default=1000, help="first N training images (default 1000)")
    parser.add_argument("--n-test", type=int, default=1000, help="first N test images (default 1000)")
    args = parser.parse_args(argv)
    try:
        written = make_sample(args.source, args.root, args.n_train, args.n_test)
    except (OSError, ValueError) as exc:
        print(f"make_sample.py: error: {exc}", file=sys.stderr)
        return 1
    for path in written:
        print(f"{path}  {path.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
