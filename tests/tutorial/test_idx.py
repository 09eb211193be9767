"""tutorial/idx.py: IDX files read without torchvision, raw or gzip-compressed, all items or the first n."""

from __future__ import annotations

import gzip
from pathlib import Path

import pytest
import torch

from pergrad_viz.tutorial.idx import read_idx

SAMPLE_RAW = Path(__file__).resolve().parents[2] / "pergrad_viz" / "tutorial" / "sample" / "FashionMNIST" / "raw"


def _images(n: int) -> tuple[bytes, torch.Tensor]:
    values = torch.arange(n * 2 * 3, dtype=torch.int64).remainder(256).to(torch.uint8).reshape(n, 2, 3)
    header = bytes.fromhex("00000803") + n.to_bytes(4, "big") + (2).to_bytes(4, "big") + (3).to_bytes(4, "big")
    return header + bytes(values.reshape(-1).tolist()), values


@pytest.mark.parametrize("compressed", [False, True])
def test_all_items_or_the_first_n_raw_or_gz(tmp_path, compressed):
    data, values = _images(7)
    path = tmp_path / ("x-idx3-ubyte.gz" if compressed else "x-idx3-ubyte")
    path.write_bytes(gzip.compress(data) if compressed else data)
    assert torch.equal(read_idx(path), values) and read_idx(path).dtype == torch.uint8
    assert torch.equal(read_idx(path, 3), values[:3])
    assert torch.equal(read_idx(path, 100), values)


def test_the_bundled_labels_are_the_bytes_after_the_header():
    labels = read_idx(SAMPLE_RAW / "train-labels-idx1-ubyte")
    raw = (SAMPLE_RAW / "train-labels-idx1-ubyte").read_bytes()[8:]
    assert labels.shape == (1000,) and labels.tolist() == list(raw)
    assert read_idx(SAMPLE_RAW / "t10k-images-idx3-ubyte", 2).shape == (2, 28, 28)


def test_not_idx_and_truncated_files_are_named(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x89PNG....")
    with pytest.raises(ValueError, match="is not an IDX file of unsigned bytes"):
        read_idx(bad)
    data, _ = _images(4)
    short = tmp_path / "short"
    short.write_bytes(data[:-5])
    with pytest.raises(ValueError, match="is truncated"):
        read_idx(short)
    read_idx(short, 3)  # the first 3 items are all there
