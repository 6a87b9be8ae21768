"""The package layout shows the architecture and keeps one import direction (docs/architecture.md):
- no module of the package imports upward into a room that imports it back (no cycle between top-level rooms);
- inside `engine/`, the top (loop, scheduler, policy, runner, state) uses the subpackages, a subpackage never
  imports the top, and `kv/` and `search/` import no `model/`; no cycle between the subpackages."""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "triton_vlm"
ENGINE_SUBS = ("kv", "model", "search", "lora", "cpu")


def _imports(path: Path) -> list[str]:
    """Every module name `path` imports from the package (module level and lazy), resolved."""
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    pkg = parts[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(pkg[:len(pkg) - (node.level - 1)])
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out += [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names]
    return [m for m in out if m.startswith("triton_vlm.")]


def _room(mod: str, depth: int) -> str:
    return ".".join(mod.split(".")[1:1 + depth])


def _edges(root: Path, room) -> set[tuple[str, str]]:
    edges = set()
    for path in root.rglob("*.py"):
        src = room(".".join(path.relative_to(SRC.parent).with_suffix("").parts))
        for target in _imports(path):
            dst = room(target)
            if src and dst and src != dst:
                edges.add((src, dst))
    return edges


def _cycles(edges: set[tuple[str, str]]) -> list[tuple[str, str]]:
    """Pairs (a, b) with a path a -> b and b -> a."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)

    def reach(a: str) -> set[str]:
        seen, todo = set(), [a]
        while todo:
            for n in graph.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    return sorted((a, b) for a, b in edges if a in reach(b))


def _engine_room(mod: str) -> str:
    parts = mod.split(".")
    if parts[1:2] != ["engine"]:
        return ""
    return parts[2] if len(parts) > 3 and parts[2] in ENGINE_SUBS else "top"


def test_engine_subpackages_import_one_way():
    edges = _edges(SRC / "engine", _engine_room)
    assert not [e for e in edges if e[1] == "top"], "a subpackage imports the engine's top"
    assert not {("kv", "model"), ("search", "model")} & edges
    assert not _cycles(edges), _cycles(edges)
    assert {("top", s) for s in ("kv", "model", "search", "lora")} <= edges  # the top uses every subpackage


def test_no_cycle_between_top_level_rooms():
    edges = _edges(SRC, lambda mod: _room(mod, 1))
    assert not _cycles(edges), _cycles(edges)
