"""No import cycles between the modules of our packages, TYPE_CHECKING imports included.

A cycle hidden behind ``if TYPE_CHECKING`` or a function-level import still couples two modules
both ways (neither can be read, tested or moved without the other), so the graph is built from
every import grimp finds, and each strongly connected component of more than one module fails.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[2]
# Our top-level packages, as pyproject.toml lists them for import-linter.
PACKAGES = tuple(
    tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["root_packages"])


def cycles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work: list[tuple[str, list[str]]] = [(root, sorted(edges.get(root, ())))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, todo = work[-1]
            if todo:
                nxt = todo.pop()
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, sorted(edges.get(nxt, ()))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component: list[str] = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def test_no_import_cycles_between_our_modules() -> None:
    graph = grimp.build_graph(*PACKAGES, exclude_type_checking_imports=False, cache_dir=None)
    edges = {m: graph.find_modules_directly_imported_by(m) for m in graph.modules}
    found = cycles(edges)
    assert not found, "import cycles (each line: modules importing each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_the_check_finds_a_cycle_hidden_behind_a_longer_loop() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(edges) == [["a", "b", "c"]]
    assert cycles({"x": {"y"}, "y": set()}) == []
