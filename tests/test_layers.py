"""The package's shape holds: import contracts (pyproject.toml [tool.importlinter]) and no import loops."""

from __future__ import annotations

from pathlib import Path

import grimp
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_hold(monkeypatch):
    """storage -> engine -> inputs -> capture | compare -> present -> orchestrate -> api -> cli, compare apart from
    engine and inputs, and cli through api only."""
    monkeypatch.chdir(ROOT)
    assert lint_imports(config_filename=str(ROOT / "pyproject.toml"), no_cache=True) == 0


def import_loops(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm): every import loop, lazy
    imports inside functions included."""
    index, low, stack, on_stack, loops = {}, {}, [], set(), []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                loops.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return loops


def test_no_import_loops():
    assert import_loops(grimp.build_graph("qeval", cache_dir=None)) == []


def test_import_loops_finds_a_loop():
    """The loop finder itself can fail: a two-module loop and a self-contained chain."""
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.a")
    graph.add_import(importer="p.c", imported="p.a")
    assert import_loops(graph) == [["p.a", "p.b"]]
