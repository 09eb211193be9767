"""Build notebooks from jupytext percent sources and execute them top to bottom (outputs committed for nbval).

Used by tools/build_notebooks.py and by tests/test_notebooks_committed.py (which checks that a committed notebook
is what its source builds). A source is a real Python file, ``notebooks/src/NN_name.py`` for
``notebooks/NN_name.ipynb``, in jupytext's percent format:

    # %% [markdown]
    # # A title and narrative
    # %%
    # NBVAL_CHECK_OUTPUT
    print("a code cell whose output nbval compares")
    # %% tags=["raises-exception"]
    ...

Two cell tags mean something here:

* ``snapshot``: the cell runs at build time only, after the cell before it, and its outputs *replace* that
  cell's outputs; the cell itself is not written. For a widget: the committed notebook then shows pictures of
  its last figures (on GitHub, and before it is run) instead of a widget view whose state no kernel holds.
* ``raises-exception``: the cell is expected to raise (nbval and the build let it).

IPython magics are written as comments in percent sources (``# %matplotlib inline``) and restored by jupytext.
"""

from __future__ import annotations

import time
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

SNAPSHOT = "snapshot"
KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}


def source_notebook(source: Path, *, build: bool = False) -> nbformat.NotebookNode:
    """The notebook a percent source describes, without outputs: cells and tags as in the source, the python3
    kernel; with ``build`` the ``snapshot`` cells are kept (to run them), else dropped (as committed)."""
    nb = jupytext.read(source, fmt="py:percent")
    cells = []
    for cell in nb.cells:
        cell.source = cell.source.strip("\n")
        tags = [t for t in cell.metadata.get("tags", []) if t]
        cell.metadata = {"tags": tags} if tags else {}
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
        if build or SNAPSHOT not in tags:
            cells.append(cell)
    out = nbformat.v4.new_notebook()
    out.cells = [_fresh(c) for c in cells]
    out.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": {"name": "python"}}
    return out


def _fresh(cell: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A cell as nbformat makes it (with an id), carrying the source's text and tags."""
    make = nbformat.v4.new_code_cell if cell.cell_type == "code" else nbformat.v4.new_markdown_cell
    new = make(cell.source)
    if cell.metadata.get("tags"):
        new.metadata["tags"] = list(cell.metadata["tags"])
    return new


def cell_summary(nb: nbformat.NotebookNode) -> list[tuple[str, str, tuple[str, ...]]]:
    """(type, source, tags) of each cell: what must match between a committed notebook and its source."""
    out = []
    for cell in nb.cells:
        source = cell.source if isinstance(cell.source, str) else "".join(cell.source)
        out.append((cell.cell_type, source.strip("\n"), tuple(cell.get("metadata", {}).get("tags", []))))
    return out


def _apply_snapshots(nb: nbformat.NotebookNode) -> None:
    """Move each snapshot cell's outputs onto the code cell before it, drop the snapshot cells, and number the
    remaining code cells 1..n in order."""
    kept: list[nbformat.NotebookNode] = []
    for cell in nb.cells:
        if SNAPSHOT in cell.get("metadata", {}).get("tags", []):
            target = next((c for c in reversed(kept) if c.cell_type == "code"), None)
            if target is None:
                raise ValueError("a 'snapshot' cell needs a code cell before it whose outputs it replaces")
            target.outputs = cell.outputs
            continue
        kept.append(cell)
    nb.cells = kept
    count = 0
    for cell in nb.cells:
        if cell.cell_type == "code":
            count += 1
            cell.execution_count = count
            for out in cell.outputs:
                if "execution_count" in out:
                    out["execution_count"] = count


def build(source: Path, target: Path, timeout: int = 600) -> float:
    """Execute ``source``'s notebook (kernel: python3, i.e. this Python's environment) in ``target``'s folder and
    write it to ``target`` with its outputs; returns the run time in seconds."""
    nb = source_notebook(source, build=True)
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(target.parent)}},
                   allow_errors=False, store_widget_state=False).execute()
    elapsed = time.perf_counter() - start
    _apply_snapshots(nb)
    nb.metadata = {"kernelspec": dict(KERNELSPEC), "language_info": nb.metadata.get("language_info", {})}
    nbformat.validate(nb)
    nbformat.write(nb, target)
    return elapsed
