"""IDX files (the format of MNIST and Fashion-MNIST), read without torchvision: uncompressed or gzip-compressed."""

from __future__ import annotations

import gzip
import math
import struct
from pathlib import Path

import torch


def read_idx(path: Path, limit: int | None = None) -> torch.Tensor:
    """An IDX file of unsigned bytes as a uint8 tensor of its shape, e.g. (N, 28, 28) images or (N,) labels; only
    the first ``limit`` items are read when given. A name ending in ``.gz`` is read through gzip.

    Raises:
        ValueError: not an IDX file of unsigned bytes, or shorter than its header says.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        magic = f.read(4)
        if len(magic) < 4 or magic[:3] != b"\x00\x00\x08" or not magic[3]:
            raise ValueError(f"{path} is not an IDX file of unsigned bytes (its first bytes are {magic.hex()})")
        dims = struct.unpack(f">{magic[3]}I", f.read(4 * magic[3]))
        n = dims[0] if limit is None else min(limit, dims[0])
        size = n * math.prod(dims[1:])
        data = f.read(size)
    if len(data) != size:
        raise ValueError(f"{path} is truncated: {len(data)} of the {size} bytes its header promises for {n} items")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(n, *dims[1:])
