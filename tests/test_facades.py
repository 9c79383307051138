"""The public facades (``ringlet.distributed``, ``ringlet.nn``, ``ringlet.utils`` and every module
below them) mirror torch's module paths, hold no logic, and take their name lists from the
implementation instead of copying them.

A facade ``ringlet.X`` stands for ``torch.X``: a script migrated by replacing ``torch.`` with
``ringlet.`` in its imports must find every name there.  The names a facade exports beyond torch's
module are listed below with the reason.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import warnings

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FACADE_PACKAGES = ("distributed", "nn", "utils")

_C10D_EXTRAS = {
    "agree": "ringlet's cross-rank agreement on a value (docs/debugging.md)",
    "report_stragglers": "ringlet's straggler report (docs/debugging.md)",
    "stats": "ringlet's per-group communication counters",
    "comm_buffer": "ringlet's shared-memory communication buffers",
    "is_comm_buffer": "ringlet's shared-memory communication buffers",
}
_TORCH_TOP_LEVEL = ("torch defines it in torch.distributed (from its C extension), not in "
                    "distributed_c10d; ringlet's c10d API is one list")
# module -> {name: why ringlet exports it although torch's module of that path has no such name}
RINGLET_ONLY: dict[str, dict[str, str]] = {
    "ringlet.distributed": {
        **_C10D_EXTRAS,
        "AllgatherOptions": "torch has it only in torch._C._distributed_c10d; ringlet lists all "
                            "the Options classes together",
        "CollectiveTimeoutError": "ringlet's DistError subclasses carry rank, group, op and peer",
        "CollectiveMismatchError": "ringlet's DistError subclasses carry rank, group, op and peer",
        "PeerFailureError": "ringlet's DistError subclasses carry rank, group, op and peer",
        "GroupAbortedError": "ringlet's DistError subclasses carry rank, group, op and peer",
    },
    "ringlet.distributed.distributed_c10d": {
        **_C10D_EXTRAS,
        **{name: _TORCH_TOP_LEVEL for name in ("is_available", "set_debug_level",
                                               "set_debug_level_from_env", "breakpoint",
                                               "_make_nccl_premul_sum")},
    },
    "ringlet.distributed._tensor.api": {
        name: "the legacy _tensor path re-exports ringlet.distributed.tensor whole"
        for name in ("DeviceMesh", "init_device_mesh", "Partial", "Placement", "Replicate", "Shard")
    },
    "ringlet.distributed.checkpoint": {
        "Stateful": "torch keeps it in .stateful only; ringlet also exports it with save/load",
    },
    "ringlet.distributed.elastic": {
        "heartbeat": "tells ringlet-run --heartbeat-timeout that a rank is making progress",
    },
}


def facade_modules() -> list[str]:
    """Every module under the facade packages, private ones included (``_tensor``, ...)."""
    names = []
    for pkg in FACADE_PACKAGES:
        for path in sorted((ROOT / "ringlet" / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__main__":
                continue
            if parts[-1] == "__init__":
                parts.pop()
            names.append(".".join(parts))
    return names


def _source(module: str) -> pathlib.Path:
    path = ROOT.joinpath(*module.split("."))
    return path / "__init__.py" if path.is_dir() else path.with_suffix(".py")


def _torch_module(module: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # torch's deprecated paths (_tensor, launch) warn
        return importlib.import_module("torch" + module.removeprefix("ringlet"))


@pytest.mark.parametrize("module", facade_modules())
def test_every_name_in_all_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    assert hasattr(mod, "__all__"), f"{module}: expected an __all__ (possibly empty)"
    names = list(mod.__all__)
    assert len(names) == len(set(names)), f"{module}: __all__ repeats {names}"
    missing = [n for n in names if not hasattr(mod, n)]
    assert not missing, f"{module}: __all__ names that do not resolve: {missing}"


@pytest.mark.parametrize("module", facade_modules())
def test_facade_matches_torch_module_path(module: str) -> None:
    try:
        theirs = _torch_module(module)
    except ImportError as err:
        pytest.fail(f"{module} has no torch counterpart: {err}")
    extras = RINGLET_ONLY.get(module, {})
    ours = importlib.import_module(module).__all__
    unknown = [n for n in ours if not hasattr(theirs, n) and n not in extras]
    assert not unknown, (f"{module} exports names that {theirs.__name__} lacks: {unknown}; "
                         "add them to RINGLET_ONLY with the reason, or drop them")
    stale = [n for n in extras if n not in ours or hasattr(theirs, n)]
    assert not stale, f"RINGLET_ONLY[{module!r}] lists names that need no reason: {stale}"


def test_ringlet_only_lists_name_facades() -> None:
    assert set(RINGLET_ONLY) <= set(facade_modules())


def _is_all_value(node: ast.expr) -> bool:
    """``["a", *_impl_all, ...]``: strings and imported lists only."""
    return isinstance(node, ast.List | ast.Tuple) and all(
        (isinstance(e, ast.Constant) and isinstance(e.value, str))
        or (isinstance(e, ast.Starred) and isinstance(e.value, ast.Name)) for e in node.elts)


def _is_entry_point(node: ast.stmt) -> bool:
    """``if __name__ == "__main__": main()``."""
    return (isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and not node.orelse
            and all(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call)
                    and not s.value.args and not s.value.keywords for s in node.body))


def _logic(tree: ast.Module) -> list[str]:
    found = []
    for k, node in enumerate(tree.body):
        if k == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue                                    # the docstring
        if isinstance(node, ast.Import | ast.ImportFrom) or _is_entry_point(node):
            continue
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else (
            node.target if isinstance(node, ast.AnnAssign) else None)
        if (isinstance(target, ast.Name) and target.id == "__all__" and node.value is not None
                and _is_all_value(node.value)):
            continue
        found.append(f"line {node.lineno}: {ast.unparse(node).splitlines()[0]}")
    return found


@pytest.mark.parametrize("module", facade_modules())
def test_facade_holds_no_logic(module: str) -> None:
    tree = ast.parse(_source(module).read_text())
    found = _logic(tree)
    assert not found, f"{module}: a facade only imports and lists names; found {found}"


@pytest.mark.parametrize("module", facade_modules())
def test_facade_takes_lists_instead_of_copying_them(module: str) -> None:
    """A facade that publishes an implementation module's whole list star-imports it and takes
    its ``__all__``; literal names in ``__all__`` never repeat a list the facade imported."""
    tree = ast.parse(_source(module).read_text())
    copied, taken = [], set()
    for node in tree.body:
        if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("ringlet"):
            continue
        impl = importlib.import_module(node.module)
        impl_all = set(getattr(impl, "__all__", ()))
        if node.names[0].name == "*":
            taken |= impl_all
            continue
        names = {a.name for a in node.names if a.asname is None}
        if len(impl_all) > 1 and impl_all <= names:
            copied.append(f"{node.module} (import *, take its __all__)")
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__":
            literal = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
            copied += [f"{name!r} again" for name in sorted(literal & taken)]
    assert not copied, f"{module} copies name lists by hand: {copied}"


def test_the_check_for_logic_catches_code() -> None:
    """The AST check must fail on a function, a class and a computed __all__."""
    src = ('"""doc"""\nfrom x import *\n__all__ = sorted(["a"])\ndef f():\n    pass\n'
           'class C:\n    pass\n_cache = {}\n')
    assert len(_logic(ast.parse(src))) == 4
    assert _logic(ast.parse('"""d"""\nfrom x import a\n__all__ = ["a", *_b]\n'
                            'if __name__ == "__main__":\n    main()\n')) == []
