"""Version 0.1's flat module paths keep working (pergrad_viz/moved.py): the same module object at its new place,
with a DeprecationWarning naming the new path; the public API did not move."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import pergrad_viz as pv
from pergrad_viz.moved import MOVED

_CHECK_ALL = """
import importlib, json, sys, warnings
moved = json.loads(sys.argv[1])
found = {}
for old, new in moved.items():
    try:
        warnings.simplefilter('always')
        with warnings.catch_warnings(record=True) as seen:
            module = importlib.import_module(old)
        target = importlib.import_module(new)
        assert module is target, (module, target)
        assert target.__spec__.name == new, target.__spec__.name
        assert any(new in str(w.message) and w.category is DeprecationWarning for w in seen), [str(w.message)
                                                                                               for w in seen]
        found[old] = None
    except BaseException as e:
        found[old] = f"{type(e).__name__}: {e}"
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def old_paths() -> dict:
    """Every old path imported in one fresh process (each old name is imported there for the first time)."""
    import json

    result = subprocess.run([sys.executable, "-c", _CHECK_ALL, json.dumps(MOVED)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_gives_the_module_at_its_new_place_and_names_it(old, old_paths):
    assert old_paths[old] is None, old_paths[old]


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
