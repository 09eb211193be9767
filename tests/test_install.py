"""`pip install .` as a user does it: build the wheel, install it into a fresh virtual environment, and run the
README's quick start, the CLI's help and a small benchmark from a directory outside the repository.

The fresh environment reuses the torch (and everything else) already installed here through a ``.pth`` file, so
nothing is downloaded; only pergrad_viz itself comes from the wheel, which is what is under test: the package
data (the bundled sample), the metadata, and that nothing needs the repository's checkout. About 30-60 s (each
process imports torch). Deselect with ``-m "not install"``. Also: the README stays short and its links resolve,
and the version is the same in every file that states it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

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
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(the wheel, the fresh venv's python, a working directory outside the repository)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"  # build from a copy: the build writes build/ and *.egg-info next to its sources
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    shutil.copytree(REPO / "pergrad_viz", src / "pergrad_viz", ignore=ignore)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, src / name)
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                  "-w", str(tmp / "dist"), str(src)], cwd=tmp, timeout=300)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp / "dist").glob("pergrad_viz-*.whl")

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
    # torch and the other dependencies: this environment's site-packages, after the new one's. A plain path line:
    # the .pth files in there (this checkout's editable install among them) are not run.
    ours = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    (site / "_reuse_installed_dependencies.pth").write_text("".join(f"{p}\n" for p in ours))
    work = tmp / "elsewhere"
    work.mkdir()
    return wheel, python, work


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
