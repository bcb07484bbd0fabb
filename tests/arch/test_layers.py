"""The rooms of docs/architecture.md import only downward, and no module imports itself back.

Every `import` in dsv4/ (module level or inside a function) is resolved to the dsv4 module it
names; a module may import its own room or a room of lower rank, never a room above it or a
different room of the same rank, and the module graph has no cycles.
"""
from __future__ import annotations

import ast
import pathlib

import dsv4

PACKAGE = pathlib.Path(dsv4.__file__).parent
# room -> rank; a room imports only rooms of lower rank (and itself)
RANKS = {"config_parse": 0, "config": 0.5, "sampling_params": 0.5,
         "text": 1, "structured": 1.5, "ops": 2, "model": 3, "assets": 3.5, "parallel": 3.7, "cache": 4,
         "engine": 5, "disagg": 5.5, "serve": 6, "bench": 6, "router": 6.5, "cli": 7}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None          # None: the package's own __init__


def test_every_room_has_a_rank():
    rooms = {_room(m) for m in _modules()} - {None}
    assert rooms <= set(RANKS), f"rooms without a rank in this test: {sorted(rooms - set(RANKS))}"


def test_imports_point_down():
    upward = []
    for src, targets in _graph().items():
        room = _room(src)
        if room is None:
            continue
        for dst in targets:
            other = _room(dst)
            if other is not None and other != room and RANKS[other] >= RANKS[room]:
                upward.append(f"{src} -> {dst}")
    assert not upward, "imports that do not point down:\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    graph, cycles = _graph(), []
    state: dict[str, int] = {}                     # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
