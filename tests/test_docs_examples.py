"""The README's and docs/api.md's Python examples run as a reader runs them: each document's ```python blocks in
order, in one fresh interpreter, in an empty folder (a scan writes there); and the package docstring's, as a
doctest. A block that used a name no block of its document defines (README's scan used `dataset`, api.md's DP block
`loss_fn`, `dataset`, `q` and `steps`) failed with a NameError."""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def python_blocks(document: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", document.read_text(), flags=re.S)


@pytest.mark.parametrize("document", ["README.md", "docs/api.md"])
def test_a_documents_examples_run_in_order(document, tmp_path):
    blocks = python_blocks(ROOT / document)
    assert blocks, f"{document} has no python example"
    script = "import torch\ntorch.set_num_threads(1)\n" + "\n".join(blocks)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_package_docstrings_example_runs():
    import pergrad_viz

    result = doctest.testmod(pergrad_viz)
    assert result.attempted and not result.failed
