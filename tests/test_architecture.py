"""The shape of the code, checked: small modules, no import cycles, no private reach-ins.

import-linter (see ``test_project``) checks the layers and cycles between sibling packages; these
tests check what it does not: a cycle between any two modules (imports inside functions and
under TYPE_CHECKING count), module size, and one module touching another's private members.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "zmqflow"
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _python_files() -> list[Path]:
    """Every Python file the project holds: the package, its tests, and the scripts beside them."""
    dirs = ("zmqflow", "tests", "bench", "protocol")
    return sorted([ROOT / "setup.py", *(p for d in dirs for p in (ROOT / d).rglob("*.py"))])


def test_no_module_is_over_500_lines():
    big = {str(p.relative_to(ROOT)): n for p in _python_files()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}


def _import_graph() -> dict[str, set[str]]:
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("zmqflow", exclude_type_checking_imports=False)
    return {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_between_any_two_modules():
    assert _cycles(_import_graph()) == []


def _owned_private_attributes(tree: ast.AST) -> set[str]:
    """Private names a module defines itself: ``self._x = ...``, private methods and functions."""
    owned = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr.startswith("_")
                and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            owned.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name.startswith("_"):
            owned.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id.startswith("_"):
            owned.add(node.target.id)  # dataclass fields and slots
    return owned


def _reach_ins(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    owned = _owned_private_attributes(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{path.name}:{node.lineno}: imports {a.name}" for a in node.names if _private(a.name)]
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        base = node.value
        if isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in sys.stdlib_module_names):
            continue
        if node.attr in owned:  # the module's own class, seen from another instance (``other._jobs``)
            continue
        found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_reach_in_finder_sees_a_reach_in(tmp_path):
    probe = PACKAGE / "_probe_reach_in.py"
    try:
        probe.write_text("def f(sess):\n    return sess._call_task(1)\n")
        assert _reach_ins(probe) == ["zmqflow/_probe_reach_in.py:2: sess._call_task"]
    finally:
        probe.unlink()


def test_no_module_touches_another_modules_private_members():
    found = [hit for p in _modules() for hit in _reach_ins(p)]
    assert found == []


def test_a_served_task_loads_no_test_transport_and_no_statistics():
    """Every module a task imports stays resident in every task: the fault injector and the
    in-process transport are for tests, and statistics pulls in decimal and fractions."""
    import subprocess

    code = ("import sys, zmqflow.cli.main, zmqflow.cli.serve, zmqflow.server.task; "
            "print(sorted(m for m in ('zmqflow.transport.faults', 'zmqflow.transport.local', 'statistics') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
