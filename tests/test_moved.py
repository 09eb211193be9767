"""Version 0.1's flat module paths keep working (pergrad_viz/moved.py): the same module object at its new place,
with a DeprecationWarning naming the new path; the public API did not move."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import pergrad_viz as pv
from pergrad_viz.moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_module_at_its_new_place_and_names_it(old):
    code = (f"import warnings, importlib\nwarnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as seen:\n    old = importlib.import_module({old!r})\n"
            f"new = importlib.import_module({MOVED[old]!r})\nassert old is new, (old, new)\n"
            f"assert new.__spec__.name == {MOVED[old]!r}, new.__spec__.name\n"
            f"assert any({MOVED[old]!r} in str(w.message) and w.category is DeprecationWarning for w in seen)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_new_paths_exist_and_the_public_api_stayed():
    for new in MOVED.values():
        importlib.import_module(new)
    assert callable(pv.scan) and callable(pv.load_scan) and callable(pv.per_sample_grads)
    with pytest.warns(DeprecationWarning, match="pergrad_viz.tutorial.networks"):
        assert pv.models.MLP is importlib.import_module("pergrad_viz.tutorial.networks").MLP
    assert callable(pv.scan), "an old path must not replace the function pv.scan"


def test_import_pergrad_viz_alone_warns_nothing():
    result = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c",
                             "import pergrad_viz, pergrad_viz.widgets; from pergrad_viz import bench, viz; "
                             "bench.sweep; viz.gradient_heatmap"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
