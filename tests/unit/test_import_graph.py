"""The structure drawn from the imports has no circles: in cli/, appliance/ and bench/, no
module reaches itself again by following what it imports.

Drawn from the source (ast), not from what Python loaded: an import inside a function counts
(it only hides a circle until that function runs), and so does one under TYPE_CHECKING (the
two modules still need each other to be read). A module's own packages are left out, since
Python imports them first whatever the module says; `from package import name` points at
the module `package/name.py` when there is one, else at the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("cli", "appliance", "bench")


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, tops: tuple[str, ...]) -> dict[str, set[str]]:
    """Each module under the tops, and the modules under the tops it imports anywhere."""
    files = {module_name(p, root): p for top in tops for p in (root / top).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = []
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets += [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base
                            for a in node.names]
        graph[module] = {t for t in targets if t in files and t != module
                         and not module.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of two or more modules (Tarjan's algorithm, without
    recursion): each is a circle, or several sharing modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, onward = work[-1]
            step = next(onward, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def test_cli_appliance_and_bench_import_without_a_circle():
    graph = import_graph(ROOT, TOPS)
    assert len(graph) > 100 and graph["cli.main"], "the graph was not drawn"
    assert circles(graph) == []


def test_a_circle_hidden_in_a_function_or_under_type_checking_is_found(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "pkg" / "a.py").write_text("from .b import helper\n")
    (tmp_path / "pkg" / "b.py").write_text("def helper():\n    from . import c\n")
    (tmp_path / "pkg" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n")
    (tmp_path / "pkg" / "d.py").write_text("import pkg.a\n")  # into the circle, not on it
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg.c"} and graph["pkg.a"] == {"pkg.b"}
    assert circles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    (tmp_path / "pkg" / "c.py").write_text("x = 1\n")
    assert circles(import_graph(tmp_path, ("pkg",))) == []
