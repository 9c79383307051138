"""``parallelize_module``: apply parallel styles to a module tree by a plan of module paths."""

from __future__ import annotations

import fnmatch
import warnings
from typing import Any

from torch import nn

from ringlet.mesh import DeviceMesh
from ringlet.parallel.tensor_parallel._layouts import check_mesh
from ringlet.parallel.tensor_parallel.style import ParallelStyle

__all__ = ["parallelize_module"]

Plan = ParallelStyle | dict[str, Any]


def parallelize_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                       parallelize_plan: Plan | None = None, *,
                       src_data_rank: int | None = 0, strict_plan: bool = False) -> nn.Module:
    """Parallelize ``module`` (in place) on a 1-d ``device_mesh`` following ``parallelize_plan``.

    Args:
        module: the model (every rank passes the same structure and shapes).
        device_mesh: a 1-d mesh, e.g. ``mesh["tp"]`` of a 2-d mesh (default: the whole world).
        parallelize_plan: a :class:`ParallelStyle` for ``module`` itself, or a dict from
            module paths to styles or to nested plans (dicts applied to that submodule).
            A path is dot-separated child names, each an ``fnmatch`` pattern, so
            ``"layers.*.attention.wq"`` names that projection in every layer; ``""`` is
            ``module`` itself.  Entries apply in order.
        src_data_rank: the mesh coordinate whose parameter values are distributed
            (default 0, so ranks may start from different initializations); ``None``:
            every rank keeps its own values and nothing is sent.
        strict_plan: a plan key that matches no submodule raises ``ValueError`` (default:
            a ``UserWarning`` and the entry is skipped, as torch does).

    Returns:
        ``module``, parallelized.

    Raises:
        ValueError: a mesh that is not 1-d; with ``strict_plan``, a plan key that matches no
            submodule.
        NotImplementedError: a style applied to a module it does not support (e.g.
            ``ColwiseParallel`` on a norm).  Errors name the module path and the style.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], {
            "layers.*.attention.wq": ColwiseParallel(),
            "layers.*.attention.wo": RowwiseParallel(),
        })
    """
    mesh = device_mesh if device_mesh is not None else _world_mesh()
    check_mesh(mesh, "parallelize_module")
    if parallelize_plan is None:
        warnings.warn("parallelize_module: no parallelize_plan given, nothing to do", stacklevel=2)
        return module
    _apply_plan(module, mesh, parallelize_plan, "", src_data_rank, strict_plan)
    return module


def _world_mesh() -> DeviceMesh:
    from ringlet.dtensor._api import default_mesh

    return default_mesh()


def _apply_plan(module: nn.Module, mesh: DeviceMesh, plan: Plan, prefix: str,
                src_data_rank: int | None, strict: bool) -> None:
    if isinstance(plan, ParallelStyle):
        _apply_style(module, mesh, plan, prefix, src_data_rank)
        return
    if not isinstance(plan, dict):
        raise TypeError("parallelize_module: "
                        f"parallelize_plan{f' at {prefix!r}' if prefix else ''}: "
                        "expected a ParallelStyle or a dict of module paths to styles, "
                        f"got {type(plan).__name__}")
    for key, sub_plan in plan.items():
        if not isinstance(key, str):
            raise TypeError(f"parallelize_module: plan keys are module paths (str), got {key!r}")
        matches = match_paths(module, key)
        if not matches:
            msg = (f"parallelize_module: plan entry {_join(prefix, key)!r} -> {sub_plan!r} "
                   f"matches no submodule of {type(module).__name__}"
                   f"{f' at {prefix!r}' if prefix else ''}; its children are "
                   f"{[n for n, _ in module.named_children()]}")
            if strict:
                raise ValueError(msg)
            warnings.warn(f"{msg}; skipping this plan entry (strict_plan=True raises)",
                          UserWarning, stacklevel=3)
        for path, sub in matches:
            _apply_plan(sub, mesh, sub_plan, _join(prefix, path), src_data_rank, strict)


def match_paths(module: nn.Module, pattern: str) -> list[tuple[str, nn.Module]]:
    """Every ``(path, submodule)`` whose dotted path matches ``pattern`` atom by atom (pure).

    >>> [p for p, _ in match_paths(nn.Sequential(nn.Linear(1, 1), nn.ReLU()), "*")]
    ['0', '1']
    """
    if pattern == "":
        return [("", module)]
    found: list[tuple[str, nn.Module]] = [("", module)]
    for atom in pattern.split("."):
        found = [(_join(path, name), child) for path, mod in found
                 for name, child in mod.named_children()
                 if fnmatch.fnmatchcase(name, atom)]
    return found


def _join(prefix: str, path: str) -> str:
    return f"{prefix}.{path}" if prefix and path else prefix or path


def _apply_style(module: nn.Module, mesh: DeviceMesh, style: ParallelStyle, path: str,
                 src_data_rank: int | None) -> None:
    style.src_data_rank = src_data_rank
    try:
        style._apply(module, mesh)
    except (NotImplementedError, ValueError, TypeError, RuntimeError) as e:
        where = f"module {path!r}" if path else "the root module"
        try:
            named = type(e)(f"parallelize_module: {where} "
                            f"({type(module).__name__}) with {style!r}: {e}")
        except Exception:  # noqa: BLE001 - an exception type with another constructor: keep it as is
            raise e from None
        raise named from e
