"""The notebooks are committed executed, top to bottom, with enough checked cells for nbval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = {"01_per_sample_gradients.ipynb", "02_output_jacobians.ipynb", "03_explorer.ipynb",
            "04_applications.ipynb"}


def test_the_notebooks_are_there():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_executed_in_order(path: Path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    counts = [c.get("execution_count") for c in cells]
    assert None not in counts, f"{path.name}: unexecuted code cells; rebuild with tools/build_notebooks.py"
    assert counts == list(range(1, len(counts) + 1)), f"{path.name}: execution counts {counts} are not 1..n"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
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
