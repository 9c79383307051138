"""fully_shard's set-up: which parameters a call manages, where they are
registered, the first sharding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ringlet.dtensor import DTensor, Shard
from ringlet.parallel.fsdp import _device
from ringlet.parallel.fsdp._device import ShardHome
from ringlet.parallel.fsdp._mesh_info import MeshInfo
from ringlet.parallel.fsdp._param import FSDPParam
from ringlet.parallel.fsdp._param_group import FSDPParamGroup
from ringlet.parallel.fsdp._shard_math import plan_group, shard_of
from ringlet.parallel.fsdp._tp import TPLayout, tp_layout
from ringlet.parallel.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["build_group", "collect_params", "normalize_reshard_after_forward"]


def _managed_below(module: nn.Module) -> set[int]:
    """ids of parameters already managed by fully_shard calls on submodules of ``module``."""
    ids: set[int] = set()
    for m in module.modules():
        state = getattr(m, "_fsdp_state", None)
        if m is module or state is None or state.group is None:
            continue
        for p in state.group.params:
            ids.add(id(p.sharded_param))
            if p.unsharded_param is not None:
                ids.add(id(p.unsharded_param))
    return ids


def collect_params(module: nn.Module, ignored: set[nn.Parameter],
                   ) -> list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]]:
    """The parameters this call manages, in ``named_parameters`` order, each
    with its owners and names.

    A parameter registered on several modules (tied weights) appears once, with every owner.
    """
    skip = _managed_below(module) | {id(p) for p in ignored}
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]] = {}
    for prefix, m in module.named_modules(remove_duplicate=False):
        for name, p in m._parameters.items():
            if p is None or id(p) in skip:
                continue
            fqn = f"{prefix}.{name}" if prefix else name
            entry = found.setdefault(id(p), (p, [], []))
            if (m, name) not in [(o, n) for o, n in entry[1]]:
                entry[1].append((m, name))
            if fqn not in entry[2]:
                entry[2].append(fqn)
    return list(found.values())


def _shard_dim(fn: Callable[[nn.Parameter], Any] | None, p: nn.Parameter, fqn: str) -> int:
    if fn is None:
        return 0
    placement = fn(p)
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise TypeError(f"fully_shard: shard_placement_fn({fqn}): expected None or a Shard "
                        f"placement, got {placement!r}")
    dim = placement.dim
    return dim + p.dim() if dim < 0 else dim


def build_group(modules: list[nn.Module], mesh_info: MeshInfo, mp_policy: MixedPrecisionPolicy,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None,
                ignored: set[nn.Parameter],
                offload_policy: OffloadPolicy | None = None) -> FSDPParamGroup | None:
    """Shard the (remaining) parameters of ``modules`` into one group; None if they have none.

    The group computes on the mesh's device; the shards live there too, or in (pinned) CPU
    memory under :class:`CPUOffloadPolicy` on a GPU ([Note: FSDP devices] in ``_device.py``).
    Parameters elsewhere are copied there shard by shard, buffers moved there.

    A parameter that is already a DTensor (tensor parallelism) is sharded as its local tensor
    and becomes a DTensor on the combined data x tensor parallel mesh (``_tp.py``).

    Raises:
        ValueError: scalar parameters, parameters of different dtypes or devices in one group,
            an uneven split on a non-zero shard dim, or a DTensor parameter whose mesh does not
            combine with fully_shard's.
    """
    entries: list[tuple[nn.Parameter, list[tuple[nn.Module, str]], list[str]]] = []
    homes: list[nn.Module] = []
    for m in modules:            # a parameter shared by two of the modules is sharded once
        found = collect_params(m, set(ignored) | {e[0] for e in entries})
        entries += found
        homes += [m] * len(found)
    name = "+".join(type(m).__name__ for m in modules)
    _check_params(entries, name)
    home = ShardHome(_device.compute_device(mesh_info.mesh), offload_policy)
    _device.move_buffers(modules, home.device)
    if not entries:
        return None
    dims = [_shard_dim(shard_placement_fn, p, fqns[0]) for p, _, fqns in entries]
    tps = [_tp_of(p, mesh_info, d, f"{name}.{fqns[0]}") for (p, _, fqns), d in zip(entries, dims)]
    locals_ = [p._local_tensor if isinstance(p, DTensor) else p for p, _, _ in entries]
    layout = plan_group([t.shape for t in locals_], dims, mesh_info.shard_size)
    p0 = locals_[0]
    shard_buffer = home.zeros(layout.shard_numel, p0.dtype, meta=p0.device.type == "meta")
    params = []
    with torch.no_grad():
        rows = zip(entries, layout.specs, locals_, tps)
        for i, ((p, owners, fqns), spec, local, tp) in enumerate(rows):
            fp = FSDPParam(i, spec, owners, fqns, p.requires_grad, mesh_info, tp)
            # the fully_shard module whose state dict names it (fqns are relative to it)
            fp.home = homes[i]
            if p.device.type != "meta":     # copies only this rank's shard to the shard home
                fp.local_view(shard_buffer).copy_(shard_of(local.detach(), spec,
                                                           mesh_info.shard_rank))
            fp.bind_sharded(shard_buffer)
            fp.register(fp.sharded_param)
            params.append(fp)
    return FSDPParamGroup(modules[0], params, layout, shard_buffer, mesh_info, mp_policy,
                          home=home)


def _check_params(entries: list[tuple[nn.Parameter, Any, list[str]]], name: str) -> None:
    for p, _, fqns in entries:
        if p.dim() == 0:
            raise ValueError(f"fully_shard({name}): {fqns[0]}: expected a parameter with at least "
                             "1 dim, got a scalar; make it a 1-d tensor of 1 element")
    dtypes = {p.dtype for p, _, _ in entries}
    devices = {p.device.type for p, _, _ in entries}
    if len(dtypes) > 1 or len(devices) > 1:
        raise ValueError(f"fully_shard({name}): expected one dtype and one device per group, got "
                         f"dtypes {sorted(map(str, dtypes))} and devices {sorted(devices)}; call "
                         "fully_shard on the submodules that differ first")


def _tp_of(p: nn.Parameter, mesh_info: MeshInfo, dim: int, fqn: str) -> TPLayout | None:
    if not isinstance(p, DTensor):
        return None
    return tp_layout(p, mesh_info.mesh, mesh_info.placements(dim), dim, fqn)


def normalize_reshard_after_forward(value: Any, shard_size: int, where: str) -> bool | int | None:
    """``None``/bool pass through; an int is a post-forward world size: 1 means
    False, the full size True,
    a proper divisor stays an int ([Note: resharding to a smaller group] in ``_param_group``).

    Raises:
        TypeError: not None, a bool or an int.
        ValueError: an int that does not divide the shard world size.
    """
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(f"{where}: reshard_after_forward: expected None, a "
                        f"bool or an int, got {value!r}")
    if value < 1 or shard_size % value:
        raise ValueError(f"{where}: reshard_after_forward: expected an int that divides the shard "
                         f"world size {shard_size}, got {value}")
    if value == 1:
        return False
    if value == shard_size:
        return True
    return value
