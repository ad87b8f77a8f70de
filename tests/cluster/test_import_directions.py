"""The departments import only downward, and nothing imports in a circle.

The table of departments and the directions each may import is docs/ARCHITECTURE.md's
("Departments and import directions"); this test reads it from there, walks every import of
every module under the card's folders (module level and inside functions alike), and fails on
an arrow the table does not allow or on any cycle between modules.
"""

from __future__ import annotations

import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FOLDERS = ("moe", "kernels", "engine", "actors", "cluster")
TABLE_HEADING = "## Departments and import directions"


def read_table(path: str = os.path.join(ROOT, "docs", "ARCHITECTURE.md")) -> dict[str, set[str]]:
    """``{department prefix: departments it may import}`` from the doc's table."""
    text = open(path, encoding="utf-8").read()
    assert TABLE_HEADING in text, f"docs/ARCHITECTURE.md lost its section {TABLE_HEADING!r}"
    section = text.split(TABLE_HEADING, 1)[1].split("\n## ", 1)[0]
    table: dict[str, set[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`raymoe."):
            continue
        allowed = set(re.findall(r"`(raymoe\.[\w.]+)`", cells[2]))
        table[cells[0].strip("`")] = allowed
    assert table, "the departments table in docs/ARCHITECTURE.md has no rows"
    return table


def department(module: str, table: dict[str, set[str]]) -> str:
    """The longest table prefix that ``module`` falls under."""
    matches = [d for d in table if module == d or module.startswith(d + ".")]
    assert matches, f"{module} belongs to no department of docs/ARCHITECTURE.md's table: add a row"
    return max(matches, key=len)


def module_files() -> dict[str, str]:
    modules = {}
    for folder in FOLDERS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, folder)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in filenames:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    dotted = "raymoe." + os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    modules[dotted.removesuffix(".__init__")] = path
    return modules


def import_edges(modules: dict[str, str]) -> dict[str, set[str]]:
    """``{module: raymoe modules it imports}``, every import statement anywhere in the file."""
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("raymoe."):
                for alias in node.names:
                    child = f"{node.module}.{alias.name}"
                    targets.add(child if child in modules else node.module)
            elif isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name.startswith("raymoe."))
        edges[module] = {t for t in targets if t != module and t in modules}
    return edges


def direction_violations(edges: dict[str, set[str]], table: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, targets in sorted(edges.items()):
        source = department(module, table)
        for target in sorted(targets):
            dest = department(target, table)
            if dest != source and dest not in table[source]:
                bad.append(f"{module} -> {target} ({source} may not import {dest})")
    return bad


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
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


@pytest.fixture(scope="module")
def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = module_files()
    return import_edges(modules), read_table()


def test_every_department_in_the_table_exists(graph):
    edges, table = graph
    for prefix, allowed in table.items():
        for name in {prefix, *allowed}:
            assert any(m == name or m.startswith(name + ".") for m in edges), (
                f"docs/ARCHITECTURE.md's departments table names {name}, which holds no module")


def test_imports_go_only_in_the_directions_the_table_allows(graph):
    edges, table = graph
    assert direction_violations(edges, table) == []


def test_no_module_imports_in_a_circle(graph):
    edges, _ = graph
    assert cycles(edges) == []


def test_the_checks_catch_an_upward_arrow_and_a_circle(graph):
    """The checks can fail: an invented arrow up and an invented circle are reported."""
    edges, table = graph
    moe_module = next(m for m in sorted(edges) if department(m, table) == "raymoe.moe")
    cluster_module = next(m for m in sorted(edges) if department(m, table) == "raymoe.cluster")
    upward = {**edges, moe_module: edges[moe_module] | {cluster_module}}
    added = set(direction_violations(upward, table)) - set(direction_violations(edges, table))
    assert added == {f"{moe_module} -> {cluster_module} (raymoe.moe may not import raymoe.cluster)"}
    circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(circle) == [["a", "b", "c"]]
