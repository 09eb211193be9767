"""Build and execute the notebooks from their sources: ``python tools/build_notebooks.py [01 02 ...]``.

Every ``notebooks/src/NN_name.py`` (a jupytext percent file: real Python, linted with the rest of the code)
becomes ``notebooks/NN_name.ipynb``, executed top to bottom with its outputs. A new notebook needs nothing but
its source file. Pass numbers (or names) to build some only. Run it with the project's .venv Python so the
kernel sees the same packages.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from nbbuild import build  # noqa: E402

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SOURCES = NOTEBOOKS / "src"


def sources(wanted: list[str] | None = None) -> list[Path]:
    """The percent sources, sorted; only those whose name starts with one of ``wanted`` when given."""
    found = sorted(SOURCES.glob("[0-9][0-9]_*.py"))
    if wanted:
        found = [p for p in found if any(p.stem.startswith(w) for w in wanted)]
        if not found:
            raise SystemExit(f"no source in {SOURCES} starts with {' or '.join(wanted)}")
    return found


def target(source: Path) -> Path:
    return NOTEBOOKS / f"{source.stem}.ipynb"


if __name__ == "__main__":
    for src in sources(sys.argv[1:]):
        seconds = build(src, target(src))
        print(f"{target(src).name}: built from {src.relative_to(NOTEBOOKS.parent)}, executed in {seconds:.1f} s")
