"""``CommDebugMode``: count the collectives that DTensor issues inside a ``with`` block.

Tests use it to assert how a transition or an operator communicates, e.g. that a
Shard -> Replicate redistribution is one all-gather and ``clip_grad_norm_`` over
sharded gradients is a single all-reduce.  Counts are per thread (ranks may be
threads), kept in a ``ContextVar``.

Example::

    with CommDebugMode() as comm:
        dt.redistribute(mesh, [Replicate()])
    assert comm.get_comm_counts()[torch.ops._c10d_functional.all_gather_into_tensor] == 1
    assert comm.get_comm_counts() == {"all_gather": 1}     # names work too
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any, Self

import torch

__all__ = ["CommDebugMode"]

_active: contextvars.ContextVar[tuple[CommDebugMode, ...]] = contextvars.ContextVar(
    "ringlet_comm_debug", default=())


# ringlet's name of each collective -> the name of torch's functional collective for it
_TORCH_NAME = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
               "all_reduce": "all_reduce", "all_to_all": "all_to_all_single",
               "broadcast": "broadcast"}
_CANON = {**{v: k for k, v in _TORCH_NAME.items()}, **{k: k for k in _TORCH_NAME}}
_NAMESPACES = ("c10d_functional", "_c10d_functional")


def _op_key(name: str) -> Any:
    """torch's functional-collective op for ``name``: ``torch.ops.c10d_functional.<op>`` (what
    torch's CommDebugMode keys by; defined once torch's functional collectives are imported),
    else ``torch.ops._c10d_functional.<op>`` (always there), else the name itself."""
    for ns in _NAMESPACES:
        try:
            return getattr(getattr(torch.ops, ns), _TORCH_NAME[name])
        except (AttributeError, RuntimeError):
            continue
    return name


def _canon(key: Any) -> str | None:
    """ringlet's name of the collective ``key`` names (a name, an op or an op overload)."""
    if isinstance(key, str):
        return _CANON.get(key.rpartition(".")[2])
    packet = getattr(key, "overloadpacket", key)
    ns, _, name = str(getattr(packet, "_qualified_op_name", "")).partition("::")
    return _CANON.get(name) if ns in _NAMESPACES else None


class CommCounts(dict):
    """Collective counts keyed by torch's functional-collective ops
    (``torch.ops.c10d_functional.all_reduce``, ``.all_gather_into_tensor``,
    ``.reduce_scatter_tensor``, ``.all_to_all_single``, ``.broadcast``), as torch's
    ``CommDebugMode.get_comm_counts()`` is.

    Lookups also take the op of either namespace (``c10d_functional`` or ``_c10d_functional``),
    an overload of it, torch's op name or ringlet's short name (``"all_gather"``,
    ``"reduce_scatter"``, ``"all_reduce"``, ``"all_to_all"``, ``"broadcast"``); a collective
    that did not run counts 0.  Equality compares by collective, so
    ``counts == {"all_reduce": 1}`` and ``counts == {funcol.all_reduce: 1}`` both hold.
    """

    def _find(self, key: Any) -> Any:
        name = _canon(key)
        if name is None:
            return None
        for k in dict.keys(self):
            if _canon(k) == name:
                return k
        return None

    def __getitem__(self, key: Any) -> int:
        k = self._find(key)
        return 0 if k is None else dict.__getitem__(self, k)

    def get(self, key: Any, default: Any = None) -> Any:
        k = self._find(key)
        return default if k is None else dict.__getitem__(self, k)

    def __contains__(self, key: object) -> bool:
        return self._find(key) is not None

    def by_name(self) -> dict[str, int]:
        """The counts keyed by ringlet's short names."""
        return {str(_canon(k)): v for k, v in dict.items(self)}

    def add(self, name: str) -> None:
        """Count one collective of ringlet's name ``name``."""
        k = self._find(name)
        if k is None:
            k = _op_key(name)
        dict.__setitem__(self, k, dict.get(self, k, 0) + 1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        theirs = {}
        for k, v in other.items():
            name = _canon(k)
            if name is None:
                return False
            theirs[name] = v
        return self.by_name() == theirs

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    __hash__ = None

    def __reduce__(self) -> Any:          # op objects do not pickle: their names travel
        return (_from_names, (self.by_name(),))


def _from_names(names: dict[str, int]) -> CommCounts:
    out = CommCounts()
    for name, n in names.items():
        out[_op_key(name)] = n
    return out


class CommDebugMode:
    """Counts DTensor collectives while active, keyed by torch's functional-collective ops
    (:class:`CommCounts`: ``all_gather_into_tensor``, ``all_reduce``, ``reduce_scatter_tensor``,
    ``all_to_all_single``, ``broadcast``; names work as keys too); modes nest, each sees what
    ran inside it."""

    def __init__(self) -> None:
        self.comm_counts: CommCounts = CommCounts()
        self._token: Any = None

    def get_comm_counts(self) -> CommCounts:
        """The counts so far (see :class:`CommCounts`)."""
        return self.comm_counts

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def __enter__(self) -> Self:
        self.comm_counts.clear()
        self._token = _active.set(_active.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        _active.reset(self._token)

    def __repr__(self) -> str:
        return f"CommDebugMode({self.comm_counts.by_name()})"


def record(name: str) -> None:
    """Called by the communication layer for every collective it issues."""
    for mode in _active.get():
        mode.comm_counts.add(name)
