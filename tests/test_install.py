"""`pip install .` as a user does it: build the wheel, install it into a fresh virtual environment, and run the
README's quick start, the CLI's help and a small benchmark from a directory outside the repository.

The fresh environment reuses the torch (and everything else) already installed here through a ``.pth`` file, so
nothing is downloaded; only pergrad_viz itself comes from the wheel, which is what is under test: the package
data (the bundled sample), the metadata, and that nothing needs the repository's checkout. A second one, the core
install, sees only torch, numpy and what they need to run (links to them): the quick start computes there, checked
against a loop, and each extra's feature says which extra to install. About 60-90 s (each process imports torch).
Deselect with ``-m "not install"``. Also: the README stays short and its links resolve,
and the version is the same in every file that states it.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import pergrad_viz

REPO = Path(__file__).resolve().parent.parent
SAMPLE_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                "t10k-labels-idx1-ubyte")


def quick_start() -> tuple[str, list[str]]:
    """The README's quick-start code block and the output its ``# prints:`` comments promise, line by line."""
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    expected = [line.removeprefix("# prints: ") for line in code.splitlines() if line.startswith("# prints: ")]
    return code, expected


def _run(args: list[str], cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of the package's files."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # build from a copy: the build writes build/ and *.egg-info next to its sources
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "pergrad_viz", src / "pergrad_viz", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                  "-w", str(tmp / "dist"), str(src)], cwd=tmp, timeout=300)
    assert built.returncode == 0, built.stderr
    (built_wheel,) = (tmp / "dist").glob("pergrad_viz-*.whl")
    return built_wheel


def _venv_with(wheel: Path, tmp: Path, reuse: list[Path]) -> tuple[Path, Path]:
    """A fresh virtual environment with only the wheel installed and the folders ``reuse`` on its path (a plain
    .pth line each: the .pth files in them are not run). Returns (its python, its site-packages)."""
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    # pip from here, installing into the new environment (before it can see this one's packages).
    done = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                 str(wheel)], cwd=tmp, timeout=300)
    assert done.returncode == 0, done.stderr
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp).stdout.strip())
    (site / "_reuse_installed_dependencies.pth").write_text("".join(f"{p}\n" for p in reuse))
    return python, site


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the wheel, a fresh venv's python, a working directory outside the repository); torch and everything else
    from this environment's site-packages, after the new one's."""
    tmp = tmp_path_factory.mktemp("install")
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    python, _ = _venv_with(wheel, tmp, [Path(p) for p in ours])
    work = tmp / "elsewhere"
    work.mkdir()
    return wheel, python, work


CORE = ("torch", "numpy")  # what `pip install pergrad-viz` requires; every other package is an extra
EXTRA_MODULES = ("matplotlib", "torchvision", "tqdm", "ipywidgets", "IPython", "transformers", "timm", "peft",
                 "opacus", "backpack", "jupyterlab", "scipy", "PIL", "yaml")


def _closure(names: tuple[str, ...]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` need to run: they and their requirements, recursively (no extras;
    requirements not installed here are left out, like the CUDA libraries of a CPU build)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        try:
            seen[name] = dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


@pytest.fixture(scope="module")
def bare(wheel, tmp_path_factory) -> tuple[Path, Path]:
    """(the python of a fresh venv holding the wheel and, reused from here through links, only torch, numpy and
    what they need to run; a working directory outside the repository). No matplotlib, torchvision, tqdm, ..."""
    tmp = tmp_path_factory.mktemp("bare")
    links = tmp / "core-deps"
    links.mkdir()
    for dist in _closure(CORE):
        tops = {Path(str(f)).parts[0] for f in dist.files or () if not str(f).startswith("..")}
        for top in tops:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (links / top).exists() and not top.endswith(".pth"):
                (links / top).symlink_to(source)
    python, _ = _venv_with(wheel, tmp, [links])
    work = tmp / "elsewhere"
    work.mkdir()
    return python, work


@pytest.mark.install
def test_the_core_install_needs_torch_and_numpy_only(wheel):
    with zipfile.ZipFile(wheel) as z:
        metadata = next(z.read(n).decode() for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    required = [r for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M) if "extra ==" not in r]
    assert sorted(Requirement(r).name for r in required) == sorted(CORE)
    extras = set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.M))
    assert {"viz", "widgets", "tutorial", "bench", "notebooks", "dp", "peers", "hf", "dev"} <= extras
    pinned = [r for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M) if "==" in r.split(";")[0]]
    assert not pinned, f"exact pins belong in requirements.txt, not in the package's metadata: {pinned}"


QUICK_START_CHECK = """
import torch
from torch import nn
import pergrad_viz as pv
from pergrad_viz.tutorial.data import load_sample

torch.manual_seed(0)
model, loss_fn = nn.Sequential(nn.Flatten(), nn.Linear(784, 20), nn.ReLU(), nn.Linear(20, 10)), nn.CrossEntropyLoss()
x, y = load_sample(16, flatten=False)
G = pv.per_sample_grads(model, loss_fn, x, y, flat=True)
rows = []
for i in range(16):  # the definition: each sample alone, one backward
    model.zero_grad()
    loss_fn(model(x[i:i + 1]), y[i:i + 1]).backward()
    rows.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
torch.testing.assert_close(G, torch.stack(rows), rtol=1e-5, atol=1e-6)
print("per-sample gradients equal the loop", tuple(G.shape))
"""


@pytest.mark.install
def test_without_extras_the_quick_start_computes_and_the_extras_are_absent(bare):
    python, work = bare
    missing = ("import importlib.util as u; "
               f"print(' '.join(m for m in {EXTRA_MODULES!r} if u.find_spec(m) is not None))")
    present = _run([str(python), "-c", missing], cwd=work)
    assert present.returncode == 0, present.stderr
    assert present.stdout.split() == [], f"the bare environment sees extras: {present.stdout}"
    code, expected = quick_start()
    (work / "quick_start.py").write_text(code + QUICK_START_CHECK)
    result = _run([str(python), "quick_start.py"], cwd=work, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [*expected, "per-sample gradients equal the loop (16, 15910)"]


FEATURES = """
import sys
import pergrad_viz as pv
from pergrad_viz.errors import MissingExtraError

def extra_named(call):
    try:
        call()
    except MissingExtraError as e:
        assert isinstance(e, ImportError)
        return str(e).split("pip install ")[1].split()[0]
    return "(ran)"

print(extra_named(lambda: pv.viz))
print(extra_named(lambda: pv.widgets.explorer))
from pergrad_viz.tutorial.data import load_sample
print(extra_named(lambda: load_sample(5, dataset="mnist", root="mnist", download=True)))
from pergrad_viz.bench import peers, problems
print(extra_named(lambda: peers.make_peer("opacus", None, None, None, None)))
print(extra_named(lambda: problems.problem("resnet18", 2)))
from pergrad_viz.tutorial import hf_models
print(extra_named(lambda: hf_models.gpt2()))
import contextlib, io
from pergrad_viz.cli.main import main
for args in (["--model", "resnet18"], ["--plot", "p.png"]):  # the command line: refused before any timing
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["bench", "--batch-sizes", "2", *args]) == 2
    assert err.getvalue().startswith("error: "), err.getvalue()
    print(err.getvalue().split("pip install ")[1].split()[0])
assert main(["scan", "--data", "fashion-mnist-sample", "--model", "mlp", "--limit", "20", "--batch-size", "10",
             "--quantities", "loss,grad_norm", "--out", "scan-out", "--no-progress", "--device", "cpu"]) == 0
print(pv.load_scan("scan-out")["grad_norm"].shape)
"""


@pytest.mark.install
def test_without_extras_each_feature_names_its_extra_and_the_cli_runs(bare):
    python, work = bare
    result = _run([str(python), "-c", FEATURES], cwd=work, timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:8] == ["'pergrad-viz[viz]'", "'pergrad-viz[widgets]'", "'pergrad-viz[tutorial]'",
                         "'pergrad-viz[peers]'", "'pergrad-viz[bench]'", "'pergrad-viz[hf]'",
                         "'pergrad-viz[bench]'", "'pergrad-viz[viz]'"]
    assert "scanned 20 of 20 examples" in result.stdout and lines[-1] == "torch.Size([20])"
    top = _run([str(python), "-m", "pergrad_viz", "--help"], cwd=work)
    assert top.returncode == 0 and "scan-bench" in top.stdout, top.stderr


@pytest.mark.install
def test_the_wheel_holds_the_sample_the_licence_and_the_metadata(installed):
    wheel, _, _ = installed
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{dist_info}/METADATA").decode()
    for name in SAMPLE_FILES:
        assert f"pergrad_viz/tutorial/sample/FashionMNIST/raw/{name}" in names
    assert {"pergrad_viz/tutorial/sample/README.md", "pergrad_viz/tutorial/sample/make_sample.py",
            "pergrad_viz/__main__.py"} <= names
    assert any(n.startswith(f"{dist_info}/licenses/LICENSE") for n in names)
    assert re.search(rf"^Version: {re.escape(pergrad_viz.__version__)}$", metadata, re.M)
    assert re.search(r"^Requires-Python: >=3\.11$", metadata, re.M)
    assert {"notebooks", "dev", "peers", "hf"} <= set(re.findall(r"^Provides-Extra: (\S+)$", metadata, re.M))
    assert not any(n.startswith(("tests/", "data/", "notebooks/")) for n in names)


@pytest.mark.install
def test_the_readme_quick_start_runs_from_another_directory(installed):
    _, python, work = installed
    code, expected = quick_start()
    assert len(expected) >= 2, "the quick start promises its output in '# prints:' comments"
    (work / "quick_start.py").write_text(code)
    # Which pergrad_viz ran (stderr), then the README's code as a script.
    runner = ("import runpy, sys, importlib.metadata as m, pergrad_viz as pv; "
              "print(pv.__file__, pv.__version__, m.version('pergrad-viz'), file=sys.stderr); "
              "runpy.run_path('quick_start.py', run_name='__main__')")
    result = _run([str(python), "-c", runner], cwd=work, timeout=300)
    assert result.returncode == 0, result.stderr
    where, version, meta_version = result.stderr.splitlines()[0].split()
    assert Path(where).is_relative_to(python.parent.parent), f"imported {where}, not the installed package"
    assert version == meta_version == pergrad_viz.__version__
    assert result.stdout.splitlines() == expected


@pytest.mark.install
def test_the_cli_help_and_a_small_bench_run_from_another_directory(installed):
    _, python, work = installed
    top = _run([str(python), "-m", "pergrad_viz", "--help"], cwd=work)
    assert top.returncode == 0, top.stderr
    assert "usage: python -m pergrad_viz" in top.stdout and "scan-bench" in top.stdout
    bench_help = _run([str(python), "-m", "pergrad_viz", "bench", "--help"], cwd=work)
    assert bench_help.returncode == 0, bench_help.stderr
    assert "max |diff|" in bench_help.stdout
    bench = _run([str(python), "-m", "pergrad_viz", "bench", "--batch-sizes", "2", "--hidden", "8", "--strategies",
                  "loop,hooks", "--min-run-time", "0.01", "--no-progress"], cwd=work, timeout=300)
    assert bench.returncode == 0, bench.stderr
    rows = [line.split()[3] for line in bench.stdout.splitlines() if line.startswith("grads ")]
    assert rows == ["loop", "hooks", "forward+backward", "memory"]


def test_the_readme_is_short_and_its_links_resolve():
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) < 200
    for page in (readme, *sorted((REPO / "docs").glob("*.md"))):
        for link in re.findall(r"\]\(([^)#\s]+)\)", page.read_text()):
            if not link.startswith(("http://", "https://")):
                assert (page.parent / link).exists(), f"{page.name} links to {link}, which does not exist"


def test_the_version_is_one_everywhere():
    yaml = pytest.importorskip("yaml")
    version = pergrad_viz.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = { attr = "pergrad_viz.__version__" }' in pyproject
    assert re.search(rf"^## {re.escape(version)}$", (REPO / "CHANGELOG.md").read_text(), re.M)
    citation = yaml.safe_load((REPO / "CITATION.cff").read_text())
    # CFF 1.2.0's required keys; every author has a name.
    assert citation["cff-version"] == "1.2.0"
    assert {"message", "title", "authors"} <= set(citation)
    assert all("name" in a or "family-names" in a for a in citation["authors"])
    assert citation["version"] == version and citation["license"] == "MIT"
    assert (REPO / "LICENSE").read_text().startswith("MIT License")
