"""The package's import graph has no cycle (module-level imports, and the
imports inside functions too): every layer builds on the ones below it."""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1] / "megac"


def _modules() -> dict[str, Path]:
    mods = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = p
    return mods


def _graph() -> nx.DiGraph:
    mods = _modules()
    g = nx.DiGraph()
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for t in targets:
                while t not in mods and "." in t:
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != m and not m.startswith(t + "."):
                    g.add_edge(m, t)
    return g


def test_no_import_cycles():
    g = _graph()
    assert g.number_of_edges() > 100  # the walk found the package's imports
    cycles = list(nx.simple_cycles(g))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles[:5])


def test_layers():
    """The compiler does not know the executors, the executors not the server."""
    g = _graph()
    below = {"megac.passes": ("megac.vm", "megac.engine", "megac.server", "megac.runtime"),
             "megac.ops": ("megac.vm", "megac.passes", "megac.engine", "megac.server", "megac.runtime"),
             "megac.vm": ("megac.engine", "megac.server"),
             "megac.engine": ("megac.server",)}
    for a, b in g.edges:
        for low, highs in below.items():
            if a == low or a.startswith(low + "."):
                assert not any(b == h or b.startswith(h + ".") for h in highs), f"{a} imports {b}"
