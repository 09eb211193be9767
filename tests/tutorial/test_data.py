"""The bundled Fashion-MNIST sample (pergrad_viz/tutorial/sample/) and its loader, tutorial.data.load_sample."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pergrad_viz.tutorial import locate
from pergrad_viz.tutorial.data import CLASS_NAMES, DATASETS, DEFAULT_ROOT, MEAN_STD, clear_cache, load_sample

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "pergrad_viz" / "tutorial" / "sample"
SAMPLE_RAW = SAMPLE / "FashionMNIST" / "raw"
MAKE_SAMPLE = SAMPLE / "make_sample.py"
DEBIAN_SOURCE = Path("/usr/share/datasets/fashion-mnist")
RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
needs_debian = pytest.mark.skipif(
    not all((DEBIAN_SOURCE / f"{name}.gz").is_file() for name in RAW_FILES),
    reason="Debian's dataset-fashion-mnist is not installed (/usr/share/datasets/fashion-mnist/)",
)


@pytest.fixture
def no_full_dataset(monkeypatch, tmp_path):
    """No full Fashion-MNIST in any place the lookup tries: the defaults are the bundled sample."""
    monkeypatch.delenv(locate.DATA_ENV, raising=False)
    monkeypatch.setattr(locate, "checkout_data", lambda: tmp_path / "no-checkout-data")
    monkeypatch.setattr(locate, "DEBIAN_SOURCE", tmp_path / "no-debian")


def test_default_root_is_the_sample_inside_the_package():
    assert DEFAULT_ROOT == SAMPLE
    assert all((SAMPLE_RAW / name).is_file() for name in RAW_FILES)
    assert set(DATASETS) == set(CLASS_NAMES) == set(MEAN_STD)
    assert all(len(names) == 10 for names in CLASS_NAMES.values())
    fashion = CLASS_NAMES["fashion-mnist"]
    assert fashion[0] == "T-shirt/top" and fashion[9] == "Ankle boot"


def test_sample_files_have_idx_headers_for_1000_images():
    for prefix in ("train", "t10k"):
        images = (SAMPLE_RAW / f"{prefix}-images-idx3-ubyte").read_bytes()
        labels = (SAMPLE_RAW / f"{prefix}-labels-idx1-ubyte").read_bytes()
        assert images[:16] == bytes.fromhex("00000803 000003e8 0000001c 0000001c")
        assert len(images) == 16 + 1000 * 28 * 28
        assert labels[:8] == bytes.fromhex("00000801 000003e8")
        assert len(labels) == 8 + 1000


@pytest.mark.parametrize("train", [True, False])
def test_load_sample_shapes_dtypes_and_values(train):
    X, y = load_sample(train=train)
    assert X.shape == (1000, 784) and X.dtype == torch.float32 and X.device.type == "cpu"
    assert y.shape == (1000,) and y.dtype == torch.int64
    assert torch.isfinite(X).all()
    mean, std = MEAN_STD["fashion-mnist"]
    # x/255 in [0, 1] maps to [-mean/std, (1-mean)/std] = [-0.81, 2.02]; both ends occur in real images.
    assert X.min().item() == pytest.approx(-mean / std, abs=1e-5)
    assert X.max().item() == pytest.approx((1 - mean) / std, abs=1e-5)
    assert abs(X.mean().item()) < 0.1
    assert 0.9 < X.std().item() < 1.1
    assert y.min().item() >= 0 and y.max().item() <= 9
    assert set(y.tolist()) == set(range(10))


def test_first_n_are_a_prefix_and_the_first_label_matches_the_source():
    X, y = load_sample(1000)
    X5, y5 = load_sample(5)
    assert torch.equal(X5, X[:5]) and torch.equal(y5, y[:5])
    assert y[0].item() == 9  # Fashion-MNIST's first training image is an ankle boot
    source = DEBIAN_SOURCE / "train-labels-idx1-ubyte.gz"
    if not source.is_file():
        pytest.skip(f"{source} absent: cannot compare with the Debian source")
    with gzip.open(source, "rb") as f:
        header = f.read(9)
    assert header[:4] == bytes.fromhex("00000801")
    assert y[0].item() == header[8]


def test_flatten_on_and_off_agree():
    X_flat, y_flat = load_sample(50)
    X_img, y_img = load_sample(50, flatten=False)
    assert X_img.shape == (50, 1, 28, 28)
    assert torch.equal(X_img.reshape(50, -1), X_flat)
    assert torch.equal(y_img, y_flat)


def test_train_and_test_differ():
    X_train, y_train = load_sample(100, train=True)
    X_test, y_test = load_sample(100, train=False)
    assert not torch.equal(X_train, X_test)
    assert not torch.equal(y_train, y_test)


def test_dtype_and_device():
    X32, _ = load_sample(10)
    X64, y = load_sample(10, dtype=torch.float64, device="cpu")
    assert X64.dtype == torch.float64 and y.dtype == torch.int64
    assert torch.allclose(X64.float(), X32, atol=1e-6)


def test_returns_fresh_tensors_from_the_cache():
    X1, y1 = load_sample(20)
    X1.zero_()
    y1.fill_(-1)
    X2, y2 = load_sample(20)
    assert X2.abs().sum() > 0 and (y2 >= 0).all()
    assert X2.data_ptr() != X1.data_ptr() and y2.data_ptr() != y1.data_ptr()


def test_works_from_any_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    X, y = load_sample(3)
    assert X.shape == (3, 784) and y.shape == (3,)


def test_mnist_is_read_when_present_with_its_own_normalisation(tmp_path):
    # Real MNIST is not bundled: stand the Fashion-MNIST sample in for it to exercise the MNIST branch.
    shutil.copytree(SAMPLE_RAW, tmp_path / "MNIST" / "raw")
    X, y = load_sample(100, dataset="mnist", root=tmp_path)
    X_f, y_f = load_sample(100, root=SAMPLE)
    assert torch.equal(y, y_f)
    (m, s), (m_f, s_f) = MEAN_STD["mnist"], MEAN_STD["fashion-mnist"]
    assert torch.allclose(X * s + m, X_f * s_f + m_f, atol=1e-5)  # same x / 255
    assert not torch.allclose(X, X_f)


def test_rebuilt_files_are_read_again(tmp_path):
    shutil.copytree(SAMPLE_RAW, tmp_path / "FashionMNIST" / "raw")
    assert load_sample(10, root=tmp_path)[1][0].item() == 9
    labels = tmp_path / "FashionMNIST" / "raw" / "train-labels-idx1-ubyte"
    data = bytearray(labels.read_bytes())
    data[8] = 3
    labels.write_bytes(bytes(data))  # copytree kept the old modification time: this one is newer
    assert load_sample(10, root=tmp_path)[1][0].item() == 3  # no stale cache
    clear_cache()
    assert load_sample(10, root=tmp_path)[1][0].item() == 3


# --- errors -------------------------------------------------------------------------------------------


def test_unknown_dataset():
    expected = r"unknown dataset 'cifar10'; valid datasets: 'fashion-mnist', 'mnist'"
    with pytest.raises(ValueError, match=expected):
        load_sample(dataset="cifar10")


@pytest.mark.parametrize("n", [0, -5])
def test_n_below_one(n):
    with pytest.raises(ValueError, match=rf"n must be at least 1, got {n}"):
        load_sample(n)


def test_n_not_an_integer():
    with pytest.raises(TypeError):
        load_sample(2.5)  # type: ignore[arg-type]


def test_non_floating_dtype():
    with pytest.raises(ValueError, match="floating dtype"):
        load_sample(10, dtype=torch.int64)


@pytest.mark.parametrize(
    ("train", "split", "flag"), [(True, "training", "--n-train"), (False, "test", "--n-test")]
)
def test_n_larger_than_available(train, split, flag, no_full_dataset):
    with pytest.raises(ValueError) as info:
        load_sample(1001, train=train)  # the bundled sample: no full dataset anywhere
    message = str(info.value)
    assert f"only 1000 {split} images are available" in message
    assert "make data" in message
    # found by a probe: the command named had no --root, so it rewrote the installed package's own sample files
    assert f"python -m pergrad_viz.tutorial.sample.make_sample {flag} 1001 --root DIR` and pass root='DIR'" in message


def test_n_larger_than_available_under_another_root_names_that_root(tmp_path):
    shutil.copytree(SAMPLE_RAW, tmp_path / "FashionMNIST" / "raw")
    with pytest.raises(ValueError, match=r"pergrad_viz\.tutorial\.sample\.make_sample --n-train 2000 --root "):
        load_sample(2000, root=tmp_path)


def test_mnist_absent(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_sample(10, dataset="mnist", root=tmp_path)
    message = str(info.value)
    assert "mnist not found" in message
    assert "download=True" in message
    assert str(tmp_path / "MNIST" / "raw") in message
    assert "train-images-idx3-ubyte" in message


def test_fashion_mnist_absent(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_sample(10, root=tmp_path)
    message = str(info.value)
    assert "fashion-mnist not found" in message
    assert f"python -m pergrad_viz.tutorial.sample.make_sample --root {tmp_path}`" in message
    assert "download=True" in message


def test_one_raw_file_missing_is_named(tmp_path):
    # torchvision needs all four files, whichever split is read.
    shutil.copytree(SAMPLE_RAW, tmp_path / "FashionMNIST" / "raw")
    (tmp_path / "FashionMNIST" / "raw" / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match=r"missing in .*: t10k-labels-idx1-ubyte\)"):
        load_sample(10, train=True, root=tmp_path)


# --- pergrad_viz/tutorial/sample/make_sample.py ----------------------------------------------------------------


def _run_make_sample(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(MAKE_SAMPLE), *args], capture_output=True, text=True, timeout=120, check=False
    )


@needs_debian
def test_make_sample_reproduces_the_bundled_files_byte_for_byte(tmp_path):
    result = _run_make_sample("--source", str(DEBIAN_SOURCE), "--root", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in RAW_FILES:
        made = (tmp_path / "FashionMNIST" / "raw" / name).read_bytes()
        assert made == (SAMPLE_RAW / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "FashionMNIST" / "raw").iterdir()) == sorted(RAW_FILES)


@needs_debian
def test_make_sample_counts_are_honoured_and_read_by_the_loader(tmp_path):
    result = _run_make_sample("--root", str(tmp_path), "--n-train", "1500", "--n-test", "7")
    assert result.returncode == 0, result.stderr
    X, y = load_sample(1500, root=tmp_path)
    assert X.shape == (1500, 784)
    assert torch.equal(y[:1000], load_sample(1000)[1])
    with pytest.raises(ValueError, match="only 7 test images"):
        load_sample(8, train=False, root=tmp_path)


@needs_debian
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--n-train", "0"), "--n-train must be at least 1"),
        (("--n-test", "10001"), "holds 10000 items; cannot take the first 10001"),
    ],
)
def test_make_sample_errors_write_nothing(tmp_path, args, message):
    result = _run_make_sample("--root", str(tmp_path), *args)
    assert result.returncode == 1
    assert message in result.stderr
    assert not (tmp_path / "FashionMNIST").exists()


def test_make_sample_missing_source(tmp_path):
    result = _run_make_sample("--source", str(tmp_path / "nowhere"), "--root", str(tmp_path))
    assert result.returncode == 1
    assert "apt-get install dataset-fashion-mnist" in result.stderr
    assert not (tmp_path / "FashionMNIST").exists()


def test_the_command_the_messages_name_runs_from_any_directory(tmp_path):
    # The errors of load_sample tell users to run `python -m pergrad_viz.tutorial.sample.make_sample`: it must exist
    # as a
    # module wherever the package is (a checkout or an install), not as a script in a repository folder.
    result = subprocess.run(
        [sys.executable, "-m", "pergrad_viz.tutorial.sample.make_sample", "--source", str(tmp_path / "nowhere"),
         "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert "apt-get install dataset-fashion-mnist" in result.stderr


# --- where the full Fashion-MNIST is looked for (pergrad_viz/tutorial/locate.py) ------------------------------


def _fake_full_dataset(folder: Path, label: int, n: int = 5) -> None:
    """The four gzip-compressed IDX files of a tiny 'full' Fashion-MNIST whose labels are all ``label``."""
    folder.mkdir(parents=True)
    for prefix in ("train", "t10k"):
        images = bytes.fromhex("00000803") + n.to_bytes(4, "big") + (28).to_bytes(4, "big") * 2
        images += bytes((label * 20 + i) % 256 for i in range(n * 28 * 28))
        labels = bytes.fromhex("00000801") + n.to_bytes(4, "big") + bytes([label] * n)
        (folder / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(images))
        (folder / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(labels))


def test_the_lookup_order_argument_env_checkout_debian_then_the_sample(tmp_path, monkeypatch, capsys):
    from pergrad_viz.tutorial.fashion_mnist import fashion_mnist

    env, checkout, debian, given = (tmp_path / n for n in ("env", "checkout", "debian", "given"))
    _fake_full_dataset(env / "fashion-mnist", 1)
    _fake_full_dataset(checkout / "fashion-mnist", 2)
    _fake_full_dataset(debian, 3)
    _fake_full_dataset(given, 4)
    monkeypatch.setenv("PERGRAD_VIZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(locate.DATA_ENV, str(env))
    monkeypatch.setattr(locate, "checkout_data", lambda: checkout)
    monkeypatch.setattr(locate, "DEBIAN_SOURCE", debian)

    def labels_found() -> tuple[int, int, int]:
        """(load_sample's label, fashion_mnist's label, fashion_mnist's length) with the defaults."""
        y = load_sample(3)[1]
        ds = fashion_mnist("test", quiet=True)
        assert y.tolist() == [y[0].item()] * 3
        return y[0].item(), ds.tensors[1][0].item(), len(ds)

    assert labels_found() == (1, 1, 5)  # $PERGRAD_VIZ_DATA first
    with pytest.raises(ValueError, match=r"full Fashion-MNIST in .*env/fashion-mnist has only 5 training images"):
        load_sample(6)
    assert fashion_mnist("train", source=given).tensors[1].tolist() == [4] * 5  # an argument wins
    monkeypatch.delenv(locate.DATA_ENV)
    assert labels_found() == (2, 2, 5)  # the checkout's data/
    monkeypatch.setattr(locate, "checkout_data", lambda: None)  # an installed package: no checkout
    assert labels_found() == (3, 3, 5)  # Debian's folder
    (debian / "t10k-labels-idx1-ubyte.gz").unlink()  # incomplete: not used
    y_sample = load_sample(3, root=SAMPLE)[1]
    assert load_sample(3)[1].tolist() == y_sample.tolist()
    ds = fashion_mnist("test")
    assert len(ds) == 1000 and "bundled sample" in capsys.readouterr().err
    with pytest.raises(ValueError, match="only 5 test images"):  # the full dataset's own count, not the sample's
        load_sample(6, train=False, root=locate.full_fashion_mnist_root(given))


def test_the_checkout_data_folder_is_the_repositorys():
    assert locate.checkout_data() == REPO / "data"
    assert (REPO / "data" / "README.md").is_file()


@needs_debian
def test_the_full_dataset_by_default_starts_with_the_bundled_sample(tmp_path, monkeypatch):
    monkeypatch.setenv("PERGRAD_VIZ_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(locate.DATA_ENV, raising=False)
    assert locate.find_fashion_mnist() is not None
    for train in (True, False):
        X, y = load_sample(1000, train=train)
        X_s, y_s = load_sample(1000, train=train, root=SAMPLE)
        assert torch.equal(X, X_s) and torch.equal(y, y_s)
    assert load_sample(5000)[0].shape == (5000, 784)


def test_a_cache_folder_one_cannot_write_names_pergrad_viz_cache(tmp_path, monkeypatch):
    """Found by a probe: with a home folder one cannot write, a scan of the full dataset died with a raw
    PermissionError from the cache's mkdir."""
    from pergrad_viz.tutorial.fashion_mnist import fashion_mnist

    source = tmp_path / "source"
    _fake_full_dataset(source, 7)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache's folder would go")
    monkeypatch.setenv("PERGRAD_VIZ_CACHE", str(blocked))
    with pytest.raises(OSError, match="cannot write the decompressed Fashion-MNIST .* set PERGRAD_VIZ_CACHE"):
        fashion_mnist("test", source=source)
    monkeypatch.setenv("PERGRAD_VIZ_CACHE", str(tmp_path / "cache"))  # the fix it names
    assert fashion_mnist("test", source=source).tensors[1].tolist() == [7] * 5
