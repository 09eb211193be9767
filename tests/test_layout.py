"""The house plan (docs/layout.md), checked: small files, no private name across modules, the layers kept
(import-linter, the contract in pyproject.toml), every module in the tree's table."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pergrad_viz"
MODULES = sorted(PACKAGE.rglob("*.py"))
MAX_LINES = 400


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_file_over_400_lines(path):
    lines = path.read_text().count("\n")
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines: split it by job (docs/layout.md)"


def _private_uses(path: Path) -> list[str]:
    """``from x import _y``, ``import x._y``, and ``m._y`` where ``m`` is a module of the package imported here."""
    tree = ast.parse(path.read_text())
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pergrad_viz"):
            if any(part.startswith("_") and not part.startswith("__") for part in node.module.split(".")):
                found.append(f"line {node.lineno}: from {node.module}")
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"line {node.lineno}: from {node.module} import {alias.name}")
                modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("pergrad_viz"):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in modules):
            found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_private_name_across_modules(path):
    assert not _private_uses(path), (f"{path.relative_to(ROOT)} uses private names of other modules: "
                                     f"{_private_uses(path)}; make them public or move the code")


def test_the_private_name_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from pergrad_viz.engine import probe\nfrom pergrad_viz.api import _run\nprobe._assign\n")
    assert len(_private_uses(bad)) == 2


def test_the_layers_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    if not lint.exists() and shutil.which("lint-imports") is None:
        pytest.skip("import-linter is not installed (make setup installs it)")
    result = subprocess.run([str(lint) if lint.exists() else "lint-imports"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:]


def tree_paths(text: str) -> set[str]:
    """The files of docs/layout.md's tree, as paths relative to pergrad_viz/ (folders are lines ending in /)."""
    block = text.split("## The tree", 1)[1].split("```")[1]
    folders: dict[int, str] = {}
    paths = set()
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip())) // 2
        name = line.split()[0]
        if name.endswith("/"):
            folders[depth] = name
        else:
            paths.add("".join(folders[d] for d in range(1, depth)) + name)
    return paths


def test_every_module_is_in_the_tree_of_docs_layout():
    listed = tree_paths((ROOT / "docs" / "layout.md").read_text())
    modules = {str(p.relative_to(PACKAGE)) for p in MODULES}
    assert modules <= listed, f"docs/layout.md's tree does not list {sorted(modules - listed)}"
    assert listed <= modules, f"docs/layout.md's tree lists files that do not exist: {sorted(listed - modules)}"


def import_cycles(package: str = "pergrad_viz") -> list[list[str]]:
    """The package's import circles (strongly connected modules), imports under ``TYPE_CHECKING`` included: a
    circle that only type checkers follow is still two modules that each need the other."""
    grimp = pytest.importorskip("grimp")  # comes with import-linter
    graph = grimp.build_graph(package, exclude_type_checking_imports=False)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                component.append(w)
            if component:
                cycles.append(sorted([v, *component]))

    for module in sorted(edges):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_circle():
    assert import_cycles() == [], "modules that import each other: break the circle (docs/layout.md)"


def test_the_circle_check_can_fail(tmp_path, monkeypatch):
    package = tmp_path / "circled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from circled import b\n")
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circled import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("circled") == [["circled.a", "circled.b"]]


MAX_FUNCTION_LINES = 60
ONE_JOB = [p for p in MODULES if p.relative_to(PACKAGE).parts[0] in ("engine", "strategies") or p.name == "api.py"
           and p.parent == PACKAGE]


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions (and methods) of ``path`` longer than ``limit`` lines, docstring included."""
    tree = ast.parse(path.read_text())
    return [f"{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})" for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


@pytest.mark.parametrize("path", ONE_JOB, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_functions_of_one_job(path):
    assert not long_functions(path), (f"{path.relative_to(ROOT)}: functions over {MAX_FUNCTION_LINES} lines: "
                                      f"{long_functions(path)}; split them by job")


def test_the_function_length_check_can_fail(tmp_path):
    bad = tmp_path / "long.py"
    bad.write_text("def f():\n" + "    x = 1\n" * 61)
    assert long_functions(bad) == ["f (62 lines, line 1)"]
