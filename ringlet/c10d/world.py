"""The default world: ``init_process_group``, ``new_group`` and the rank/size getters.

[Note: where the world lives]
The world (default group, store, groups) lives in one place: a process-wide
slot, or -- for threads started by ``ringlet.testing`` -- a ``ContextVar`` per
thread, so that ranks can be threads in tests (both slots are in ``_current.py``, a leaf
that argument checks can read).  Objects that fire later (DDP's
reducer, FSDP's hooks, DTensor) keep the group they were built with and never
look the world up again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading
import weakref
from datetime import timedelta
from typing import Any, overload

from ringlet import _env
from ringlet.c10d import _creation, _cuda, debug
from ringlet.c10d._current import _set_world, current_world
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.rendezvous import check_ranks, rendezvous, store_from_init_method
from ringlet.transport import selection

__all__ = [
    "GroupMember",
    "create_groups",
    "current_world",
    "destroy_process_group",
    "get_backend",
    "get_default_backend_for_device",
    "get_global_rank",
    "get_group_rank",
    "get_process_group_ranks",
    "get_rank",
    "get_world_size",
    "group",
    "init_process_group",
    "is_available",
    "is_initialized",
    "new_group",
    "resolve_group",
]

@dataclasses.dataclass
class _World:
    """Everything one rank's default world holds ([Note: where the world lives])."""

    rank: int
    world_size: int
    store: Any                      # the world's prefixed store (``ringlet/<run>init<n>``)
    backend: str                    # canonical transport spec (``ringlet.transport.selection``)
    backend_name: str               # what get_backend() answers (the name the user gave)
    timeout: float
    hosts: list[str]
    raw_store: Any = None           # the store the user (or init_method) gave
    default_pg: ProcessGroup | None = None
    groups: list[ProcessGroup] = dataclasses.field(default_factory=list)
    group_counts: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)
    owns_store: bool = False
    watchdog: Any = None
    meshes: list[Any] = dataclasses.field(default_factory=list)   # weakrefs to root DeviceMeshes
    device: Any = None              # init_process_group(device_id=...): the bound CUDA device
    # group creations so far, per set of ranks that make them ([Note: group creation])
    creations: dict[tuple[int, ...], int] = dataclasses.field(default_factory=dict)


# Inits per (store, rank): every rank re-initializes on a store as often as the others, so the
# count gives all ranks the same fresh key prefix (stale keys of an earlier init are never read).
_init_counts: dict[tuple[str, int], int] = {}
_store_counts: weakref.WeakKeyDictionary[Any, dict[int, int]] = weakref.WeakKeyDictionary()


def _next_init_count(store: Any, rank: int) -> int:
    if hasattr(store, "port") and hasattr(store, "host"):   # one TCP server, many client objects
        key = (f"tcp:{store.host}:{store.port}", rank)
        _init_counts[key] = _init_counts.get(key, 0) + 1
        return _init_counts[key]
    try:
        counts = _store_counts.setdefault(store, {})
    except TypeError:      # a store that cannot be weakly referenced: count by identity
        key = (f"id:{id(store)}", rank)
        _init_counts[key] = _init_counts.get(key, 0) + 1
        return _init_counts[key]
    counts[rank] = counts.get(rank, 0) + 1
    return counts[rank]


def _world() -> _World:
    """The current world; raises (torch's message) when there is none."""
    w = current_world()
    if w is None:  # pragma: no cover - current_world raised
        raise AssertionError("no world")
    return w


class _NonMember:
    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class _WorldProxy:
    """``group.WORLD``: stands for the current default group wherever a group is accepted."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_default_pg(), name)

    def __repr__(self) -> str:
        w = current_world(required=False)
        return repr(w.default_pg) if w and w.default_pg else "group.WORLD (not initialized)"


class GroupMember:
    """torch's group markers: ``GroupMember.WORLD`` stands for the default group (it resolves at
    each use, so it may be taken before ``init_process_group``) and ``NON_GROUP_MEMBER`` is what
    ``new_group`` returns on ranks outside the new group (collectives on it return ``None``)."""

    WORLD: Any = _WorldProxy()
    NON_GROUP_MEMBER: Any = _NonMember()


class group:
    """``group.WORLD``: the default group, as in torch (the same object as ``GroupMember.WORLD``).

    Example::

        dist.all_reduce(t, group=dist.group.WORLD)     # same as group=None
    """

    WORLD: Any = GroupMember.WORLD


def _default_pg() -> ProcessGroup:
    w = current_world()
    if w is None or w.default_pg is None:  # pragma: no cover - current_world raised
        raise AssertionError("no default group")
    return w.default_pg


@overload
def resolve_group(g: None) -> ProcessGroup: ...
@overload
def resolve_group(g: GroupArg) -> ProcessGroup | None: ...


def resolve_group(g: GroupArg) -> ProcessGroup | None:
    """The ProcessGroup for a ``group=`` argument; None when this rank is not a member."""
    if g is None or g is GroupMember.WORLD:
        return _default_pg()
    if g is GroupMember.NON_GROUP_MEMBER:
        return None
    if isinstance(g, ProcessGroup):
        return g
    if hasattr(g, "_ringlet_pg"):      # objects that wrap a group (e.g. DeviceMesh views)
        return g._ringlet_pg()
    raise TypeError("group: expected a ProcessGroup (from new_group) or None, got "
                    f"{type(g).__name__}")


def _member(group: GroupArg, op: str) -> ProcessGroup:
    """The group of a query that needs membership (torch's wording, then ours)."""
    pg = resolve_group(group)
    if pg is None:
        raise ValueError(f"Invalid process group specified: {op}: this rank is not a member "
                         "of the group")
    return pg


def _timeout_seconds(timeout: timedelta | float | None) -> float:
    if timeout is None:
        return _env.timeout_seconds()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if seconds <= 0:
        raise ValueError(f"timeout: expected a positive duration, got {timeout!r}")
    return seconds


def _user_name(backend: str | None, resolved: str) -> str:
    """What get_backend() answers: the name given (lower case, as torch answers), or -- for
    ringlet's ``auto`` policy (the default) -- the transport it chose."""
    given = (backend or "").strip().lower()
    return resolved if given in ("", "auto") else given


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: timedelta | float | None = None, world_size: int = -1,
                       rank: int = -1,
                       store: Any = None, group_name: str = "", pg_options: Any = None,
                       device_id: Any = None) -> None:
    """Join the default process group (torch's signature).

    Args:
        backend: ``"auto"`` (default: shared memory among the ranks of a host, tcp among
            hosts), ``"shm"``, ``"tcp"``, ``"inproc"`` (ranks are threads; ``ringlet.testing``),
            torch's ``"gloo"`` (ringlet's ``auto``; CUDA tensors staged through host memory),
            ``"nccl"``, ``"cuda:nccl"`` or ``"cpu:gloo,cuda:nccl"`` (CUDA tensors on torch's
            NCCL, CPU tensors on ``auto``), torch's engines ``"torch:gloo"``/``"torch:nccl"``,
            or a name given to ``Backend.register_backend``.  ``get_backend()`` answers this
            name (for ``auto``: the transport chosen).
        init_method: ``env://`` (default: ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
            ``WORLD_SIZE``), ``tcp://host:port`` or ``file:///path``.
        timeout: deadline of every blocking call (default ``RINGLET_TIMEOUT`` or 300 s).
        store: a ready store (then ``rank`` and ``world_size`` are required).
        device_id: the CUDA device of this process (a ``torch.device`` or an index): it becomes
            the current device and every group's ``bound_device_id`` (docs/gpu.md).

    Raises:
        ValueError: bad configuration, naming the field and the ranks involved.
        DistStoreError: ranks that never arrived, named, after ``timeout``.

    Example::

        import ringlet.distributed as dist
        dist.init_process_group("gloo")      # under ringlet-run
        t = torch.ones(4); dist.all_reduce(t)
    """
    if current_world(required=False) is not None:
        raise ValueError("trying to initialize the default process group twice!")
    debug.setup_logging(debug.get_debug_level().name)
    name = selection.parse_backend(backend)
    seconds = _timeout_seconds(timeout)
    td = timedelta(seconds=seconds)
    bound = _cuda.bind_device(device_id, "init_process_group")
    owns = store is None
    if store is None:
        store, rank, world_size = store_from_init_method(init_method, rank, world_size, td)
    else:
        if init_method is not None:
            raise ValueError("init_process_group: give either init_method or store, not both")
        check_ranks(rank, world_size)
    from ringlet.store import PrefixStore

    count = _next_init_count(store, rank)
    root = PrefixStore(f"ringlet/{_env.run_prefix()}init{count}", store)
    hosts = rendezvous(root, rank, world_size, name, seconds)
    w = _World(rank, world_size, root, name, "", seconds, hosts, raw_store=store, owns_store=owns,
               device=bound)
    w.default_pg = _make_group(w, list(range(world_size)), "default_pg", name, backend, seconds,
                               "default_pg")
    w.backend_name = w.default_pg.backend
    w.watchdog = debug.Watchdog(root, rank, threading.get_ident(), w.groups)
    _set_world(w)
    debug.log.info("rank %d/%d joined: backend %s on transport %s, timeout %.0f s, host %s", rank,
                   world_size, w.backend_name, w.default_pg.transport_name, seconds, hosts[rank])


def _make_group(w: _World, ranks: list[int], gid: str, spec: str, given: str | None, timeout: float,
                desc: str) -> ProcessGroup:
    """Open the group's transport (``ringlet.transport.selection``) and build its ProcessGroup with
    the world's hang reporter and, at debug level DETAIL, the cross-rank argument check."""
    from ringlet.store import PrefixStore

    me = ranks.index(w.rank)
    hosts = [w.hosts[r] for r in ranks]
    if gid == "default_pg":     # the rendezvous has just seen every rank
        gstore: Any = PrefixStore(f"pg/{gid}", w.store)
    else:                       # a member that fails or leaves is named ([Note: group creation])
        gstore = _creation.SetupStore(f"pg/{gid}", w, gid, ranks, desc)
    try:
        transport, resolved = selection.open_transport(spec, gstore, me, hosts, timeout, desc)
    except BaseException as e:
        _creation.note_failure(w.store, gid, w.rank, e)
        raise
    pg = ProcessGroup(gid, ranks, me, transport, timeout, _user_name(given, resolved), desc,
                      transport_name=resolved,
                      hang_reporter=lambda g, err: debug.hang_report(w.store, g, err),
                      detail_check=debug.detail_check if debug.detail_enabled() else None)
    pg.bound_device = w.device
    w.groups.append(pg)
    return pg


def destroy_process_group(group: GroupArg = None) -> None:
    """Destroy ``group``, or (default) every group and the default world.  Bounded."""
    w = current_world(required=False)
    if w is None:
        raise ValueError("destroy_process_group: no process group is initialized")
    if group is not None and group is not GroupMember.WORLD:
        pg = resolve_group(group)
        if pg is not None:
            pg.destroy()
            if pg in w.groups:
                w.groups.remove(pg)
        return
    if w.watchdog is not None:
        w.watchdog.stop()
    _creation.note_left(w.store, w.rank, "destroy_process_group")
    for pg in reversed(w.groups):
        if debug.log.isEnabledFor(logging.INFO):
            debug.log.info("rank %d: %s: %s", w.rank, pg, debug.group_stats(pg))
        pg.destroy()
    w.groups.clear()
    if w.owns_store and w.raw_store is not None and hasattr(w.raw_store, "close"):
        w.raw_store.close()
    _set_world(None)


def is_initialized() -> bool:
    """Whether this process (or, for ranks as threads, this thread) has a default group."""
    return current_world(required=False) is not None


def is_available() -> bool:
    """Always True: ringlet's collectives need nothing beyond torch (torch's answer for a build
    with distributed support)."""
    return True


def get_rank(group: GroupArg = None) -> int:
    """This process's rank in ``group`` (default: the world); -1 if not a member."""
    pg = resolve_group(group)
    return -1 if pg is None else pg.rank()


def get_world_size(group: GroupArg = None) -> int:
    """Number of ranks in ``group`` (default: the world); -1 if this rank is not a member.

    Raises:
        ValueError: no default group (``init_process_group`` was not called), as in torch.
    """
    pg = resolve_group(group)
    return -1 if pg is None else pg.size()


def get_backend(group: GroupArg = None) -> str:
    """The backend name of ``group`` as given to ``init_process_group``/``new_group`` (lower case,
    like torch: ``"gloo"`` after ``init_process_group("gloo")``); for ``auto`` (the default), the
    transport chosen (``"shm"``, ``"tcp"``, ``"shm+tcp"``).  The transport actually running is
    ``group.transport_name`` and is shown by ``repr(group)`` and the INFO log.

    Raises:
        ValueError: this rank is not a member of ``group`` ("Invalid process group specified").
    """
    return _member(group, "get_backend").backend


def get_default_backend_for_device(device: Any) -> str:
    """torch's default backend name for a device: ``"gloo"`` for ``cpu`` (which ringlet runs on
    its own transports), ``"nccl"`` for ``cuda``.

    Args:
        device: a ``torch.device`` or a string such as ``"cpu"`` or ``"cuda:1"``.

    Raises:
        ValueError: any other device type.
    """
    kind = device if isinstance(device, str) else getattr(device, "type", str(device))
    kind = kind.split(":")[0]
    if kind == "cpu":
        return "gloo"      # torch's answer; "gloo" runs on ringlet's own CPU transports
    if kind == "cuda":
        return "nccl"
    raise ValueError(f"get_default_backend_for_device: no default backend for device type {kind!r}")


def new_group(ranks: list[int] | None = None, timeout: timedelta | None = None,
              backend: str | None = None,
              pg_options: Any = None, use_local_synchronization: bool = False,
              group_desc: str | None = None, device_id: Any = None, sort_ranks: bool = True) -> Any:
    """Create a group of ``ranks`` (global ranks).  Like torch: every rank of the world calls it
    (members only with ``use_local_synchronization=True``); non-members get
    ``GroupMember.NON_GROUP_MEMBER``.  ``sort_ranks=False`` keeps the order given: group rank
    ``i`` is ``ranks[i]`` (every member must pass the same order).

    Raises:
        ValueError: bad ``ranks``; or ranks that passed different ``ranks`` (or backends) to
            the same call, on every rank, naming each rank's list.
        PeerFailureError: a rank that left (``destroy_process_group``), died or failed to set
            the group up instead of joining; named at once, not at the timeout."""
    w = _world()
    members = _members(w, ranks, sort_ranks)
    return create_groups([members], timeout, backend, [group_desc or f"group{members}"],
                         local=use_local_synchronization, what="new_group")[0]


def _members(w: _World, ranks: Any, sort_ranks: bool = True) -> list[int]:
    """``new_group``'s ``ranks`` checked (and sorted unless ``sort_ranks=False``)."""
    members = list(range(w.world_size) if ranks is None else ranks)
    if any(isinstance(r, bool) or not isinstance(r, int) for r in members):
        raise ValueError(f"new_group: ranks: expected ints (global ranks), got {ranks!r}")
    if sort_ranks:
        members.sort()
    if len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks: expected distinct ranks, got {ranks}")
    if not members or not all(0 <= r < w.world_size for r in members):
        raise ValueError(f"new_group: ranks: expected ranks in [0, {w.world_size}), got {ranks}")
    return members


def create_groups(lists: list[list[int]], timeout: timedelta | float | None = None,
                  backend: str | None = None, descs: list[str] | None = None, *,
                  local: bool = False, scope: list[int] | None = None,
                  what: str = "new_group") -> list[Any]:
    """Create one group per list of global ranks (checked, in group-rank order) as one creation
    ([Note: group creation] in ``_creation.py``): every rank of ``scope`` (default: the world;
    ``local=True``: the members of the one list) calls it with the same lists; returns, per
    list, the group or ``GroupMember.NON_GROUP_MEMBER``.  ``DeviceMesh`` creates all of its
    groups with one call."""
    w = _world()
    spec = selection.parse_backend(backend) if backend else w.backend
    seconds = _timeout_seconds(timeout) if timeout is not None else w.timeout
    gids = []
    for members in lists:
        key = tuple(members)
        count = w.group_counts.get(key, 0)
        w.group_counts[key] = count + 1
        gids.append(hashlib.sha1(repr(key).encode()).hexdigest()[:12] + f"-{count}")
    if local:
        scope = list(lists[0])
    _creation.agree(w, sorted(scope) if scope is not None else list(range(w.world_size)),
                    [list(m) for m in lists], spec, what)
    out: list[Any] = []
    for i, (members, gid) in enumerate(zip(lists, gids, strict=True)):
        if w.rank not in members:
            out.append(GroupMember.NON_GROUP_MEMBER)
            continue
        desc = descs[i] if descs else f"group{list(members)}"
        out.append(_make_group(w, list(members), gid, spec, backend or w.backend_name, seconds,
                               desc))
    return out


def get_process_group_ranks(group: GroupArg) -> list[int]:
    """The global ranks of ``group``, in group-rank order.

    Raises:
        ValueError: this rank is not a member of ``group``.
    """
    pg = _member(group, "get_process_group_ranks")
    return pg.ranks


def get_global_rank(group: GroupArg, group_rank: int) -> int:
    """The global rank of ``group``'s rank ``group_rank``.

    Raises:
        ValueError: this rank is not a member of ``group``, or ``group_rank`` is out of range.
    """
    pg = _member(group, "get_global_rank")
    if not 0 <= group_rank < pg.size():
        raise ValueError(f"get_global_rank: group_rank: expected 0 <= group_rank < {pg.size()}, "
                         f"got {group_rank}")
    return pg.ranks[group_rank]


def get_group_rank(group: GroupArg, global_rank: int) -> int:
    """The rank within ``group`` of the global rank ``global_rank``.

    Raises:
        ValueError: this rank is not a member of ``group``, or ``global_rank`` is not in it.
    """
    pg = _member(group, "get_group_rank")
    if global_rank not in pg.ranks:
        raise ValueError(f"get_group_rank: global rank {global_rank} is not part of group "
                         f"{pg.ranks}")
    return pg.ranks.index(global_rank)
