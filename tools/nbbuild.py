"""Write a notebook from a list of cells and execute it top to bottom (outputs committed for nbval).

Used by tools/build_notebooks.py: ``python tools/build_notebooks.py [name ...]``.
A cell is ``md(text)`` or ``code(source, tags=...)``; ``# NBVAL_CHECK_OUTPUT`` in a code cell's first
line makes nbval compare its output.
"""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def md(text: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(text.strip("\n"))


def code(source: str, tags: tuple[str, ...] = ()) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source.strip("\n"))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def build(path: Path, cells: list[nbformat.NotebookNode], timeout: int = 600) -> float:
    """Write ``cells`` to ``path`` executed (kernel: this Python); returns the run time in seconds."""
    nb = nbformat.v4.new_notebook()
    nb.cells = cells
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                   allow_errors=False).execute()
    elapsed = time.perf_counter() - start
    nbformat.write(nb, path)
    return elapsed
