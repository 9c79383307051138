"""DDP, Join and the reducer talk through narrow, documented interfaces (issue 31 item 3):
Join's hook uses the model's public methods and the reducer's, DDP does not reach into the
reducer's private state, and a bucket counts its own members in (``arrive``/``mark_unused``)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from ringlet.parallel.ddp._bucket_state import Bucket
from ringlet.parallel.ddp._buckets import plan_buckets

DDP_DIR = pathlib.Path(__file__).resolve().parents[1] / "ringlet" / "parallel" / "ddp"

pytestmark = pytest.mark.timeout(60)

# What DDPJoinHook and active_iteration may use of the model, and of its reducer.
MODEL_INTERFACE = {"process_group", "device", "broadcast_buffers", "reducer", "sync_buffers",
                   "sync_parameters_and_buffers"}
REDUCER_INTERFACE = {"rebuild_pending", "rebuild_buckets", "shadow_backward", "annotate"}


def _tree(name: str) -> ast.Module:
    path = DDP_DIR / name
    return ast.parse(path.read_text(), str(path))


def _chain(node: ast.expr) -> list[str]:
    """``ddp.reducer.annotate`` -> ["ddp", "reducer", "annotate"] ([] if not rooted at a name)."""
    names: list[str] = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return [node.id, *reversed(names)] if isinstance(node, ast.Name) else []


def _model_uses(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Attributes read of the model (``ddp.x``, ``self.ddp.x``) and of its reducer."""
    model, reducer = set(), set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = _chain(node)
        if chain[:2] == ["self", "ddp"]:
            chain = chain[1:]
        if chain[:1] == ["ddp"] and len(chain) >= 2:
            model.add(chain[1])
            if chain[1] == "reducer" and len(chain) >= 3:
                reducer.add(chain[2])
    return model, reducer


def test_join_uses_the_models_documented_interface_only() -> None:
    model, reducer = _model_uses(_tree("_join.py"))
    assert model <= MODEL_INTERFACE, f"_join.py uses more of DDP: {sorted(model - MODEL_INTERFACE)}"
    assert reducer <= REDUCER_INTERFACE, (
        f"_join.py uses more of the reducer: {sorted(reducer - REDUCER_INTERFACE)}")
    from ringlet.nn.parallel import DistributedDataParallel as DDP
    from ringlet.parallel.ddp._reducer import Reducer

    for cls, names in ((DDP, MODEL_INTERFACE - {"process_group", "device", "reducer"}),
                       (Reducer, REDUCER_INTERFACE)):
        for name in names:
            assert getattr(cls, name).__doc__, f"{cls.__name__}.{name} has no docstring"


def _private_uses(tree: ast.Module, roots: set[str]) -> list[str]:
    """``a._b`` (``_b`` private, not dunder) where ``a`` is not ``self`` or a name in ``roots``."""
    out = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            chain = _chain(node.value)
            if chain not in (["self"], *([r] for r in roots)):
                out.append(f"line {node.lineno}: {'.'.join(chain) or '...'}.{node.attr}")
    return out


def test_join_and_ddp_keep_to_each_others_public_side() -> None:
    # torch's own private helpers (torch._C ...) and the package's private modules are fine
    modules = {"torch", "_checks", "_options", "_tp"}
    assert _private_uses(_tree("_join.py"), modules) == []
    ddp_private = [u for u in _private_uses(_tree("ddp.py"), modules)
                   if "reducer" in u or "layout" in u]
    assert ddp_private == [], f"ddp.py reaches into the reducer: {ddp_private}"


def test_only_the_bucket_counts_its_members() -> None:
    for name in ("_reducer.py", "_bucket_state.py", "ddp.py", "_join.py"):
        for node in ast.walk(_tree(name)):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AugAssign) else [])
            for t in targets:
                chain = _chain(t)
                if chain and chain[-1] in ("pending", "_pending"):
                    assert name == "_bucket_state.py" and chain[0] == "self", (
                        f"{name}:{node.lineno} writes {'.'.join(chain)}")


def _bucket(members: int) -> Bucket:
    params = [torch.zeros(3) for _ in range(members)]
    plan, = plan_buckets([3] * members, [torch.float32] * members, list(range(members)),
                         cap_bytes=1 << 20)
    return Bucket(0, plan, params)


def test_bucket_arrive_and_mark_unused_count_members_in() -> None:
    b = _bucket(3)
    assert (b.pending, b.ready) == (3, False)
    assert b.arrive() is False
    assert b.mark_unused() is False
    assert b.arrive() is True                 # the last member: ready to reduce
    assert (b.pending, b.ready) == (0, True)
    with pytest.raises(AssertionError, match="bucket 0 expected at most 3 members"):
        b.arrive()
    with pytest.raises(AssertionError, match="an unused mark"):
        b.mark_unused()
    b.reset()
    assert (b.pending, b.ready) == (3, False)
    with pytest.raises(AttributeError):
        b.pending -= 1                        # only arrive/mark_unused count members in
