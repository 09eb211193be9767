"""The notebooks are committed executed, top to bottom, built from their jupytext sources (notebooks/src/*.py),
with enough checked cells for nbval."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from build_notebooks import sources, target  # noqa: E402
from nbbuild import SNAPSHOT, cell_summary, source_notebook  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXPECTED = {"01_per_sample_gradients.ipynb", "02_output_jacobians.ipynb", "03_explorer.ipynb",
            "04_applications.ipynb"}
# The explorer's notebook is a dashboard (Voila shows its outputs): no printed checks there. Its checks live in
# tests/explorer/test_widgets.py, tests/explorer/test_explorer_model.py and the browser tests (tests/e2e).
DASHBOARDS = {"03_explorer.ipynb"}


def test_the_notebooks_are_there():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


def test_every_notebook_has_a_source_and_every_source_a_notebook():
    assert {target(s).name for s in sources()} == {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("source", sources(), ids=lambda p: p.name)
def test_committed_notebook_is_built_from_its_source(source: Path):
    """Edit notebooks/src/NN_name.py, then run tools/build_notebooks.py NN: never the .ipynb by hand."""
    committed = json.loads(target(source).read_text())
    built = source_notebook(source)
    got, want = cell_summary(committed_node(committed)), cell_summary(built)
    assert len(got) == len(want), (f"{target(source).name} has {len(got)} cells, its source {len(want)}: "
                                   f"rebuild with tools/build_notebooks.py {source.stem[:2]}")
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, (f"{target(source).name}, cell {k}: differs from {source.name}; rebuild with "
                        f"tools/build_notebooks.py {source.stem[:2]}\ncommitted: {g}\nsource:    {w}")
    assert all(SNAPSHOT not in tags for _, _, tags in got)


def committed_node(nb: dict):
    import nbformat

    return nbformat.from_dict(nb)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_executed_in_order(path: Path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in cells]
    assert None not in counts, f"{path.name}: unexecuted code cells; rebuild with tools/build_notebooks.py"
    assert counts == list(range(1, len(counts) + 1)), f"{path.name}: execution counts {counts} are not 1..n"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name not in DASHBOARDS], ids=lambda p: p.name)
def test_at_least_four_checked_cells(path: Path):
    cells = json.loads(path.read_text())["cells"]
    checked = [c for c in cells if c["cell_type"] == "code" and "NBVAL_CHECK_OUTPUT" in "".join(c["source"])]
    assert len(checked) >= 4, f"{path.name}: only {len(checked)} cells carry # NBVAL_CHECK_OUTPUT"
    assert all(c.get("outputs") for c in checked), f"{path.name}: a checked cell has no output to compare"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_figures_are_shown_as_images(path: Path):
    """A cell that returns a matplotlib Figure must show it as a picture, not only as '<Figure size ...>'."""
    for cell in json.loads(path.read_text())["cells"]:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if "".join(data.get("text/plain", "")).startswith("<Figure"):
                assert "image/png" in data, f"{path.name}: a figure is committed as text only (%matplotlib inline?)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_widget_view_without_its_state(path: Path):
    """A widget view needs its model's state, which only a kernel holds: committed, it would read "Error displaying
    widget: model not found". Widgets are committed as pictures of their figures instead (a 'snapshot' cell)."""
    nb = json.loads(path.read_text())
    views = [out for c in nb["cells"] for out in c.get("outputs", [])
             if "application/vnd.jupyter.widget-view+json" in out.get("data", {})]
    state = nb["metadata"].get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    for out in views:
        model_id = out["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
        assert model_id in state, f"{path.name}: a widget view without its state (model {model_id})"


def test_the_explorer_notebook_shows_its_figures_and_prints_nothing():
    nb = json.loads((ROOT / "notebooks" / "03_explorer.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    outputs = [out for c in code for out in c["outputs"]]
    assert not [o for o in outputs if o["output_type"] in ("stream", "error")], "the dashboard prints internals"
    pictures = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(pictures) >= 5, "the committed explorer shows its last figures as pictures"
    assert all(o.get("metadata", {}).get("image/png", {}).get("width") for o in pictures), "drawn at the size shown"
