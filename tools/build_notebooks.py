"""Regenerate and execute the notebooks: ``python tools/build_notebooks.py [01 02 ...]``.

Each notebook's cells live in tools/nbNN.py; the executed notebook (with outputs, counts 1..n) is written
to notebooks/. Run it with the project's .venv Python so the kernel sees the same packages.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from nbbuild import build  # noqa: E402

NOTEBOOKS = {
    "01": "01_per_sample_gradients.ipynb",
    "02": "02_output_jacobians.ipynb",
    "03": "03_explorer.ipynb",
    "04": "04_applications.ipynb",
}

if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent / "notebooks"
    for key in sys.argv[1:] or list(NOTEBOOKS):
        cells = importlib.import_module(f"nb{key}").CELLS
        seconds = build(root / NOTEBOOKS[key], cells)
        print(f"{NOTEBOOKS[key]}: executed in {seconds:.1f} s")
