"""Structure a contributor relies on (docs/architecture.md): each shared helper has one home,
module names do not shadow the standard library, aliases mean one module, and DTensor's
dispatch cache is DTensor's state, not the mesh's."""

from __future__ import annotations

import ast
import collections
import gc
import pathlib
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1] / "ringlet"

pytestmark = pytest.mark.timeout(60)


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(path: pathlib.Path) -> list[tuple[str, str | None]]:
    """(module or module.name, alias) of every absolute import in ``path``."""
    out: list[tuple[str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, a.asname) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(f"{node.module}.{a.name}", a.asname) for a in node.names]
    return out


def test_fully_shard_does_not_reach_into_ddp_and_both_move_inputs_with_one_helper() -> None:
    from ringlet.parallel import _device_moves
    from ringlet.parallel.ddp import ddp
    from ringlet.parallel.fsdp import _state

    bad = [f"{path}: {name}" for path in sorted((ROOT / "parallel" / "fsdp").rglob("*.py"))
           for name, _ in _imported(path) if name.startswith("ringlet.parallel.ddp")]
    assert not bad, bad
    assert ddp.move_to is _device_moves.move_to and _state.move_to is _device_moves.move_to
    obj = {"a": (torch.ones(1), [torch.zeros(2)]), "b": 3}
    moved = _device_moves.move_to(obj, torch.device("meta"))
    assert moved["a"][0].is_meta and moved["a"][1][0].is_meta and moved["b"] == 3


def test_fully_shard_takes_its_shard_sizes_from_dtensors_one_chunk_rule() -> None:
    from ringlet.dtensor import _shard_math as dt
    from ringlet.parallel.fsdp import _shard_math as fs

    assert not hasattr(fs, "chunk_units")
    assert fs.chunk_size is dt.chunk_size and fs.chunk_offset is dt.chunk_offset
    for size in range(12):
        for world in range(1, 6):
            spec = fs.plan_group([(size, 3)], [0], world).specs[0]
            assert spec.chunk == dt.padded_chunk(size, world)
            assert [spec.local_units(r) for r in range(world)] == dt.chunk_sizes(size, world)
            full = torch.arange(size * 3).view(size, 3)
            assert [fs.shard_of(full, spec, r).shape[0] for r in range(world)] == \
                [dt.chunk_size(size, world, r) for r in range(world)]


# Modules named as torch names them (ringlet.distributed.tensor.random mirrors
# torch.distributed.tensor.random); their siblings import nothing of the same name.
TORCH_PATHS = {"ringlet.dtensor.random", "ringlet.distributed.tensor.random",
               "ringlet.distributed.tensor._random"}


def test_no_module_takes_a_standard_library_modules_name() -> None:
    bad = [_module_name(p) for p in sorted(ROOT.rglob("*.py"))
           if p.stem in sys.stdlib_module_names and _module_name(p) not in TORCH_PATHS]
    assert not bad, f"rename these (their siblings would import them for the stdlib's): {bad}"


def test_an_import_alias_names_one_module_throughout_the_package() -> None:
    seen: dict[str, set[str]] = collections.defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        for name, alias in _imported(path):
            if alias:
                seen[alias].add(name)
    clashes = {alias: sorted(names) for alias, names in seen.items() if len(names) > 1}
    assert not clashes, clashes


def _decisions_body(rank: int, n: int) -> tuple[bool, int, bool, bool]:
    import weakref

    from ringlet.distributed.device_mesh import DeviceMesh
    from ringlet.distributed.tensor import Shard, distribute_tensor
    from ringlet.dtensor._spec import decisions_of

    mesh = DeviceMesh("cpu", [0])
    fresh = "_dtensor_decisions" in vars(mesh)        # nothing of DTensor's before a DTensor
    a = distribute_tensor(torch.ones(4), mesh, [Shard(0)])
    (a + a) * 2
    recorded = len(decisions_of(mesh))
    alive = weakref.ref(mesh)
    del a, mesh
    gc.collect()
    return fresh, recorded, alive() is None, "op_cache" in pathlib.Path(
        ROOT / "mesh" / "device_mesh.py").read_text()


def test_dtensor_keeps_its_dispatch_decisions_itself_and_they_go_with_the_mesh() -> None:
    from ringlet.testing import run_threads

    fresh, recorded, collected, named = run_threads(_decisions_body, 1)[0]
    assert not fresh and not named    # the mesh module knows nothing of the cache
    assert recorded >= 2              # add and mul were recorded for this mesh
    assert collected                  # the decisions do not keep their mesh alive
