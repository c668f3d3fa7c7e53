"""The product's import graph, read from the source (no imports run): ``tests/test_layout.py`` checks it."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("server", "shard_engine", "loaders")


def modules() -> dict[str, str]:
    """Every product module's dotted name -> its file."""
    out = {}
    for package in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(root, name)
                    dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    out[dotted.removesuffix(".__init__")] = path
    return out


def imports_of(path: str, known: dict[str, str]) -> set[str]:
    """The product modules ``path`` imports, at module level or inside functions."""
    tree = ast.parse(open(path).read(), path)
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports_of(p, known) - {m} for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm).

    A package's ``__init__`` re-exporting its modules is not a cycle through the package: an edge
    from a module to its own package (``from shard_engine import x`` inside ``shard_engine``) counts."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out
