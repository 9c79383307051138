"""``OpCall``: one aten call on DTensors as a sharding rule sees it, and its argument plumbing.

aten arguments nest at most one level (``Tensor[]``, ``int[]``), so arguments are
flattened by hand -- one level, lists and tuples only -- instead of with pytree, which
dominated the cost of a small op.  Facts that depend only on the op (which arguments
it writes, its schema names) are cached per overload.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch

from ringlet.dtensor import experimental
from ringlet.dtensor._api import DTensor, make_dtensor
from ringlet.dtensor._spec import DTensorSpec, Placements
from ringlet.dtensor.placements import Replicate
from ringlet.mesh import DeviceMesh

__all__ = ["OpCall", "broadcast_shapes", "flatten", "unflatten", "written_names"]

aten = torch.ops.aten
# per argument: (list or tuple, length) or None for a leaf
Spec = list[tuple[type, int] | None]


def flatten(values: Sequence[Any]) -> tuple[list[Any], Spec]:
    """One level: list and tuple arguments become their elements."""
    flat: list[Any] = []
    spec: Spec = []
    for v in values:
        t = type(v)
        if t is list or t is tuple:
            spec.append((t, len(v)))
            flat.extend(v)
        else:
            spec.append(None)
            flat.append(v)
    return flat, spec


def _list_positions(spec: Spec) -> frozenset[int]:
    """Positions in the flat argument list that are elements of a list or tuple argument."""
    out: list[int] = []
    i = 0
    for entry in spec:
        n = 1 if entry is None else entry[1]
        if entry is not None:
            out.extend(range(i, i + n))
        i += n
    return frozenset(out)


def unflatten(flat: Sequence[Any], spec: Spec, start: int = 0) -> tuple[list[Any], int]:
    """Inverse of :func:`flatten`; returns (values, next position)."""
    out: list[Any] = []
    i = start
    for entry in spec:
        if entry is None:
            out.append(flat[i])
            i += 1
        else:
            kind, n = entry
            out.append(kind(flat[i:i + n]))
            i += n
    return out, i


def _is_fused_step(func: Any) -> bool:
    """Whether ``func`` is an in-place fused optimizer step (``_fused_adamw_``, ``_fused_sgd_``)."""
    name: str = func.overloadpacket.__name__
    return name.startswith("_fused_") and name.endswith("_")


def broadcast_shapes(*shapes: Sequence[int]) -> list[int]:
    """``torch.broadcast_shapes`` without its Python-reference overhead."""
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        off = nd - len(s)
        for d, size in enumerate(s):
            cur = out[off + d]
            if size != 1:
                if cur != 1 and cur != size:
                    raise RuntimeError(f"shapes {[list(x) for x in shapes]} "
                                       "cannot be broadcast together")
                out[off + d] = size
    return out


@functools.cache
def written_names(func: Any) -> frozenset[str]:
    """Names of the arguments ``func`` writes (in-place self, ``out=``)."""
    schema = func._schema
    if not schema.is_mutable:
        return frozenset()
    return frozenset(a.name for a in schema.arguments
                     if a.alias_info is not None and a.alias_info.is_write)


class OpCall:
    """One call of an aten op on DTensors, as a rule sees it.

    ``dts`` are the DTensor arguments in argument order; rules answer with one
    placement tuple per entry.  ``slots[i]`` maps the leaves of positional argument
    ``i`` to indices in ``dts`` (``kw_slots`` for keywords).
    """

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.func = func
        self.args = args
        self.kwargs = kwargs
        self.flat, self.spec = flatten(list(args) + list(kwargs.values()))
        self.mesh = _mesh_of(func, self.flat)
        self.dts: list[DTensor] = []
        self.positions: list[int] = []
        # a 0-d plain tensor is a scalar operand, except as an element of a Tensor[] argument
        # (stack, cat, foreach ops), where it stands for a whole value; the fused optimizer
        # steps (``_fused_adamw_``...) take each parameter's step count so (``state_steps``)
        in_list = frozenset() if _is_fused_step(func) else _list_positions(self.spec)
        adopted = False
        for i, x in enumerate(self.flat):
            if isinstance(x, torch.Tensor):
                if not isinstance(x, DTensor) and (x.dim() > 0 or i in in_list):
                    x = self.flat[i] = self._adopt(i, x)
                    adopted = True
                if isinstance(x, DTensor):
                    self.dts.append(x)
                    self.positions.append(i)
        if adopted:                     # rules read ``args``: they must see the adopted values
            n = len(args)
            values, _ = unflatten(self.flat, self.spec)
            self.args, self.kwargs = tuple(values[:n]), dict(zip(kwargs, values[n:]))
        where = {pos: k for k, pos in enumerate(self.positions)}
        ranges: list[list[int | None]] = []
        offset = 0
        for entry in self.spec:
            n = 1 if entry is None else entry[1]
            ranges.append([where.get(p) for p in range(offset, offset + n)])
            offset += n
        self.slots = ranges[:len(args)]
        self.kw_slots = dict(zip(kwargs, ranges[len(args):]))
        self._meta: Any = None
        self._bound: dict[str, Any] | None = None

    def _adopt(self, i: int, x: torch.Tensor) -> Any:
        """A plain tensor among DTensors: Replicate where allowed ([Note:
        DTensor dispatch], step 1)."""
        copy_src = self.func is aten.copy_.default and i == 1
        if copy_src or experimental.implicit_replication_enabled():
            return make_dtensor(x, self.mesh, (Replicate(),) * self.mesh.ndim, x.shape, x.stride())
        # RuntimeError, not TypeError: torch turns a TypeError in ``a + b`` into NotImplemented.
        raise RuntimeError(f"{self.func}: expected DTensor arguments only, got a "
                           f"torch.Tensor of shape {list(x.shape)} mixed with DTensors; "
                           "convert it with DTensor.from_local or distribute_tensor, or run "
                           "inside implicit_replication()")

    def rebuild(self, flat: Sequence[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """(args, kwargs) with the leaves replaced by ``flat``."""
        values, _ = unflatten(flat, self.spec)
        n = len(self.args)
        return tuple(values[:n]), dict(zip(self.kwargs, values[n:]))

    @property
    def name(self) -> str:
        """The op's base name without the in-place underscore (``add_`` -> ``add``)."""
        n: str = self.func.overloadpacket.__name__
        return n[:-1] if n.endswith("_") and not n.endswith("__") else n

    @property
    def specs(self) -> list[DTensorSpec]:
        return [d._spec for d in self.dts]

    def bound(self) -> dict[str, Any]:
        """Arguments by schema name, defaults filled in."""
        if self._bound is None:
            out: dict[str, Any] = {}
            for i, a in enumerate(self.func._schema.arguments):
                if i < len(self.args) and not a.kwarg_only:
                    out[a.name] = self.args[i]
                elif a.name in self.kwargs:
                    out[a.name] = self.kwargs[a.name]
                elif a.has_default_value():
                    out[a.name] = a.default_value
            self._bound = out
        return self._bound

    def slot(self, i: int | str) -> int | None:
        """Index in ``dts`` of positional argument ``i`` (or keyword ``i``)
        when it is one DTensor."""
        leaves = (self.kw_slots.get(i, []) if isinstance(i, str)
                  else (self.slots[i] if i < len(self.slots) else []))
        return leaves[0] if len(leaves) == 1 else None

    def written_positions(self) -> set[int]:
        """Flat positions of the leaves the op writes."""
        names = written_names(self.func)
        if not names:
            return set()
        out: set[int] = set()
        offset = 0
        arg_names = [a.name for a in self.func._schema.arguments]
        keys = arg_names[:len(self.args)] + list(self.kwargs)
        for key, entry in zip(keys, self.spec):
            n = 1 if entry is None else entry[1]
            if key in names:
                out.update(range(offset, offset + n))
            offset += n
        return out

    def written(self) -> set[int]:
        """Indices in ``dts`` of the DTensors the op writes (in-place self, ``out=``)."""
        where = {pos: k for k, pos in enumerate(self.positions)}
        return {where[p] for p in self.written_positions() if p in where}

    def meta(self) -> Any:
        """The op run on meta tensors of the global shapes (cached)."""
        if self._meta is None:
            margs, mkwargs = self.rebuild([_to_meta(x) for x in self.flat])
            self._meta = self.func(*margs, **mkwargs)
        return self._meta

    def current(self) -> list[Placements]:
        return [d.placements for d in self.dts]

    def describe(self) -> str:
        names = [a.name for a in self.func._schema.arguments]
        parts = []
        for i, leaves in enumerate(self.slots):
            for j, k in enumerate(leaves):
                if k is not None:
                    label = names[i] if i < len(names) else f"arg{i}"
                    parts.append(f"{label}{f'[{j}]' if len(leaves) > 1 else ''}={self.dts[k]!r}")
        parts += [f"{key}={self.dts[k]!r}" for key, leaves in self.kw_slots.items()
                  for k in leaves if k is not None]
        return ", ".join(parts)


def _to_meta(x: Any) -> Any:
    if isinstance(x, DTensor):
        s = x._spec
        return torch.empty_strided(s.shape, s.stride, dtype=x.dtype, device="meta")
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _mesh_of(func: Any, flat: list[Any]) -> DeviceMesh:
    mesh: DeviceMesh | None = None
    for x in flat:
        if isinstance(x, DTensor):
            m = x._spec.mesh
            if mesh is None:
                mesh = m
            elif m is not mesh and m != mesh:
                raise ValueError(f"{func}: expected every DTensor argument on one "
                                 f"DeviceMesh, got {mesh!r} and {m!r}")
    if mesh is None:
        raise AssertionError(f"{func}: dispatched to DTensor without a DTensor argument")
    return mesh
