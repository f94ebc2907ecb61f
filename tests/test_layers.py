"""The package's rooms: imports point down only, no module imports itself in a circle, and no
module grows past the size where it should be split (../shared/STYLE.md)."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "spantrain_p2p"

# Lowest first. A module may import modules of its own room or of rooms below, never above.
# A room is a sub-package or a top-level module of spantrain_p2p.
LAYERS: list[set[str]] = [
    {"", "errors", "scenario", "gpus", "osproc", "files", "import_noise", "_hivemind_lite", "compress", "robust"},  # "" is spantrain_p2p/__init__.py
    {"net", "swarm", "profile"},
    {"pipeline"},
    {"plan"},
    {"sim"},
    {"models", "data"},  # what is trained: layers, transformers models, workloads; text, tokens, batches
    {"job"},  # the job record, its optimizer, data, single-process reference and export
    {"islands"},  # the outer loop of islands: outer optimizer, exchange, round members
    {"train"},  # a peer's trainer and its components
    {"view"},  # the operator's view: dashboard, /metrics, pictures of a run
    {"peer"},  # the Peer: life cycle, membership, data plane, emulation
    {"api"},  # the Python API: Job, Session, start, join, local swarms
    {"peer_command"},  # `spantrain-peer`
    {"launch"},  # local swarms of peer processes (the zygote among them)
    {"cli", "__main__"},  # `spantrain`, the operator's tool, and its subcommands
]
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every spantrain_p2p module ``name`` imports, at the top or inside a function."""
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                target = [*base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "spantrain_p2p":
                target = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                sub = ".".join([*target, alias.name])
                found.add(sub if sub in modules else ".".join(target))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "spantrain_p2p":
                    found.add(".".join(alias.name.split(".")[1:]))
    return {m for m in found if m in modules and m != name}


def _room(module: str) -> str:
    return module.split(".")[0] if module else ""


def _rank(module: str) -> int:
    room = _room(module)
    for i, layer in enumerate(LAYERS):
        if room in layer:
            return i
    raise AssertionError(f"spantrain_p2p.{module} is in no room of LAYERS: add its room to the list")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_imports_point_down_only():
    up = [f"spantrain_p2p.{a} -> spantrain_p2p.{b}" for a, targets in _graph().items() for b in sorted(targets)
          if _rank(b) > _rank(a)]
    assert not up, "imports that run back up:\n" + "\n".join(sorted(up))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_module_past_the_size_to_split():
    big = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines: {big}"
