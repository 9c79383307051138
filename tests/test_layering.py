"""Imports flow one way (docs/architecture.md#layers), and nothing under ringlet/ imports
torch.distributed except the two adapters to torch's stack (the torch-engine transport and the
torch backend)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ringlet"

# Lower number = lower layer; a module may import only its own layer or lower ones.
LAYERS = {
    "ringlet.errors": 0, "ringlet._env": 0, "ringlet._version": 0,
    "ringlet._segments": 0,         # shm segment names and their sweep (transport and launcher)
    "ringlet._heartbeat": 0,        # progress beats: c10d writes, the launcher reads
    "ringlet._compile": 0,          # torch.compiler.disable without importing torch._dynamo
    "ringlet.store": 1,
    "ringlet.transport": 2,
    "ringlet.c10d": 3,
    "ringlet.launcher": 2,          # the launcher needs only the stores (and env/errors)
    "ringlet.torch_backend": 4,     # "ringlet" as a torch.distributed backend, over c10d
    "ringlet.testing": 4,
    "ringlet.mesh": 5,              # DeviceMesh
    "ringlet.dtensor": 6,           # DTensor, placements, redistribution
    "ringlet.parallel": 7,          # DDP, Join, comm hooks, FSDP, TP, ZeRO, SyncBatchNorm, sampler
    "ringlet.checkpoint": 8,
    "ringlet.ft": 8,                # replica-level fault tolerance (quorum, healing) over c10d
    "ringlet.distributed": 9, "ringlet.nn": 9, "ringlet.utils": 9,
}
FORBIDDEN = ("torch.distributed", "torch.nn.parallel")


def _layer(module: str) -> tuple[str, int] | None:
    best = None
    for prefix, level in LAYERS.items():
        matches = module == prefix or module.startswith(prefix + ".")
        if matches and (best is None or len(prefix) > len(best[0])):
            best = (prefix, level)
    return best


def _imports(path: pathlib.Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return found


def _modules() -> list[tuple[str, pathlib.Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out.append((".".join(parts), path))
    return out


def test_nothing_imports_torch_distributed_except_the_engine_adapter() -> None:
    bad = []
    for module, path in _modules():
        if "torch_engine" in module or "torch_backend" in module:
            continue
        for line, name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN):
                bad.append(f"{path}:{line} imports {name}")
    assert not bad, "\n".join(bad)


def test_imports_flow_downwards() -> None:
    bad = []
    for module, path in _modules():
        mine = _layer(module)
        if mine is None:
            continue
        for line, name in _imports(path):
            if not name.startswith("ringlet"):
                continue
            theirs = _layer(name)
            if theirs is None or theirs[0] == mine[0]:
                continue
            if theirs[1] > mine[1] or (theirs[1] == mine[1] and theirs[0] != mine[0]):
                bad.append(f"{path}:{line}: {module} (layer {mine[1]}) imports {name} (layer "
                           f"{theirs[1]})")
    assert not bad, "\n".join(bad)


def test_every_module_is_assigned_a_layer() -> None:
    missing = [m for m, _ in _modules() if m != "ringlet" and _layer(m) is None]
    assert not missing, f"add these to LAYERS: {missing}"


def test_no_import_cycle_inside_the_package() -> None:
    """No two modules import each other, even through imports inside functions (which Python
    resolves late): a cycle means code sits in the wrong module (scripts/import_cycles.py)."""
    import importlib.util

    path = ROOT.parent / "scripts" / "import_cycles.py"
    spec = importlib.util.spec_from_file_location("_import_cycles", path)
    if spec is None or spec.loader is None:
        raise AssertionError(f"cannot load {path}")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    edges = tool.graph(tool.modules())
    found = tool.cycles(edges)
    assert not found, f"import cycles (run {path.name} for the edges): {found}"
