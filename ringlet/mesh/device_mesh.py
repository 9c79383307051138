"""``DeviceMesh``: an n-d array of global ranks with one process group per axis line.

[Note: mesh groups]
ringlet's ``new_group`` is collective over the whole world: every rank calls it for
every group, in the same order.  So a mesh creates all of its groups at construction
-- for each axis, in axis order, one group per line of ranks along that axis, lines in
row-major order of the other axes -- on every rank, member or not, as one group creation
(the ranks agree on all of its groups at once: [Note: group creation] in
ringlet/c10d/_creation.py), and keeps the ones this rank belongs to.  Slicing
(``mesh["tp"]``) is then local: a sub-mesh reuses its root's groups.  ``_flatten``
creates groups for the merged axes, so (as in torch) every rank must call it with the
same arguments.  A line that is the whole world in rank order reuses the default group.

A group's ranks are sorted while a mesh line may not be (``[[1, 0]]``); collectives
that care about order map mesh coordinates to group ranks with
:meth:`DeviceMesh._group_rank_of`.
"""

from __future__ import annotations

import contextvars
import math
import os
from typing import Any, Self

import torch

from ringlet import _env
from ringlet.c10d import world as _world
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.mesh import _registry

__all__ = ["DeviceMesh", "init_device_mesh"]

Axes = tuple[int, ...]   # the root axes that one axis of a (sliced or flattened) mesh covers


class DeviceMesh:
    """An n-d mesh of global ranks; every axis has a process group per line of ranks.

    Must be built by every rank of the world, in the same order (see [Note: mesh groups]).
    A process not in a job yet joins it first (``init_process_group()``, as torch's meshes do).

    Args:
        device_type: ``"cpu"`` (``"cuda"`` only where ``torch.cuda.is_available()``).
        mesh: global ranks as a nested list or an integer tensor, e.g. ``[[0, 1], [2, 3]]``.
        mesh_dim_names: one distinct name per axis, e.g. ``("dp", "tp")``.

    Raises:
        ValueError: unknown device type, ranks that repeat or are outside the world,
            names that repeat or do not match the number of axes.

    Example::

        mesh = DeviceMesh("cpu", [[0, 1], [2, 3]], mesh_dim_names=("dp", "tp"))
        mesh["tp"].get_group()          # the group along "tp" that holds this rank
        mesh.get_coordinate()           # e.g. [1, 0] on rank 2
    """

    def __init__(self, device_type: str, mesh: Any, *,
                 mesh_dim_names: tuple[str, ...] | None = None, _init_backend: bool = True) -> None:
        _check_device_type(device_type)
        w = joined_world(device_type)
        ranks = _as_rank_tensor(mesh, w.world_size)
        names = _check_names(mesh_dim_names, ranks.dim())
        self._setup(device_type, ranks, names, root=None,
                    axes=tuple((a,) for a in range(ranks.dim())), groups=(),
                    coord=_coordinate_of(ranks, w.rank), world_rank=w.rank)
        self._root_groups: list[ProcessGroup | None] = [None] * ranks.dim()
        if _init_backend:
            self._root_groups = _axis_groups(ranks, [(a,) for a in range(ranks.dim())], w,
                                             [names[a] if names else str(a)
                                              for a in range(ranks.dim())])
        self._groups = tuple(self._root_groups)
        self._flat: dict[Axes, ProcessGroup | None] = {}
        self._flat_names: dict[str, Axes] = {}
        _registry.register(w, self)

    def _setup(self, device_type: str, ranks: torch.Tensor, names: tuple[str, ...] | None,
               root: DeviceMesh | None, axes: tuple[Axes, ...],
               groups: tuple[ProcessGroup | None, ...], coord: tuple[int, ...] | None,
               world_rank: int) -> None:
        self._device_type = device_type
        self._mesh = ranks
        self._ranks_list = ranks.tolist()    # the same as nested lists: read without torch ops
        self._names = names
        self._root = self if root is None else root
        self._axes = axes
        self._groups = groups
        self._coord = coord
        self._world_rank = world_rank
        self._hash = hash((device_type, tuple(ranks.shape), tuple(ranks.flatten().tolist()), names))

    @classmethod
    def from_group(cls, group: GroupArg, device_type: str, mesh: Any = None, *,
                   mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
        """A 1-d mesh over an existing group (no new group is created, so
        members only may call it)."""
        _check_device_type(device_type)
        pg = _world.resolve_group(group)
        if pg is None:
            raise ValueError("DeviceMesh.from_group: this rank is not a member of the group")
        ranks = _as_rank_tensor(pg.ranks if mesh is None else mesh, max(pg.ranks) + 1)
        if ranks.dim() != 1 or sorted(ranks.tolist()) != pg.ranks:
            raise ValueError("DeviceMesh.from_group: mesh: expected a 1-d permutation of the "
                             f"group's ranks {pg.ranks}, got {ranks.tolist()}")
        names = _check_names(mesh_dim_names, 1)
        me = pg.ranks[pg.rank()]
        self = cls.__new__(cls)
        self._setup(device_type, ranks, names, None, ((0,),), (pg,), _coordinate_of(ranks, me), me)
        self._root_groups = [pg]
        self._flat = {}
        self._flat_names = {}
        w = _world.current_world(required=False)
        if w is not None:
            _registry.register(w, self)
        return self

    # -- torch's accessors -------------------------------------------------------------------
    @property
    def device_type(self) -> str:
        return self._device_type

    @property
    def mesh(self) -> torch.Tensor:
        """The global ranks of this mesh (an int64 tensor of shape ``self.shape``)."""
        return self._mesh

    @property
    def mesh_dim_names(self) -> tuple[str, ...] | None:
        return self._names

    @property
    def ndim(self) -> int:
        return self._mesh.dim()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._mesh.shape)

    def size(self, mesh_dim: int | str | None = None) -> int:
        """Number of ranks in the mesh, or along axis ``mesh_dim``."""
        if mesh_dim is None:
            return self._mesh.numel()
        return self.shape[self._axis(mesh_dim)]

    def get_rank(self) -> int:
        """This process's global rank."""
        return self._world_rank

    def get_coordinate(self) -> list[int] | None:
        """This rank's index along every axis; ``None`` when the mesh does not contain it."""
        return None if self._coord is None else list(self._coord)

    def get_local_rank(self, mesh_dim: int | str | None = None) -> int:
        """This rank's coordinate along ``mesh_dim`` (may be omitted on a 1-d mesh)."""
        axis = self._axis(mesh_dim, "get_local_rank")
        if self._coord is None:
            raise ValueError(f"get_local_rank: rank {self._world_rank} is not part of {self!r}")
        return self._coord[axis]

    def get_group(self, mesh_dim: int | str | None = None) -> ProcessGroup:
        """The process group of this rank along ``mesh_dim`` (may be omitted on a 1-d mesh).

        Returns ``GroupMember.NON_GROUP_MEMBER`` when the mesh does not contain this rank.
        """
        pg = self._groups[self._axis(mesh_dim, "get_group")]
        return _world.GroupMember.NON_GROUP_MEMBER if pg is None else pg

    def get_all_groups(self) -> list[ProcessGroup]:
        """This rank's group along every axis, in axis order."""
        return [self.get_group(a) for a in range(self.ndim)]

    def _ringlet_pg(self) -> ProcessGroup | None:
        """Lets a 1-d mesh stand wherever a ``group=`` is accepted (``resolve_group``)."""
        if self.ndim != 1:
            raise ValueError(f"group: expected a 1-d DeviceMesh, got {self!r}; pass mesh[name] or "
                             "mesh.get_group(axis)")
        return self._groups[0]

    def _group_rank_of(self, axis: int, coord: int) -> int:
        """Group rank (sorted global ranks) of the rank at ``coord`` along
        ``axis``'s line through me."""
        pg = self._groups[axis]
        if pg is None or self._coord is None:
            raise ValueError(f"rank {self._world_rank} is not part of {self!r}")
        # plain lists, no torch op: torch.compile's tracers may call this under a fake mode
        where = list(self._coord)
        where[axis] = coord
        rank: Any = self._ranks_list
        for c in where:
            rank = rank[c]
        return pg.ranks.index(int(rank))

    def _axis(self, mesh_dim: int | str | None, op: str = "size") -> int:
        if mesh_dim is None:
            if self.ndim != 1:
                raise ValueError(f"{op}: mesh_dim: expected an axis (index or name) for a "
                                 f"{self.ndim}-d mesh, got None")
            return 0
        if isinstance(mesh_dim, str):
            if not self._names or mesh_dim not in self._names:
                raise KeyError(f"{op}: mesh_dim: expected one of {self._names}, got {mesh_dim!r}")
            return self._names.index(mesh_dim)
        if not -self.ndim <= mesh_dim < self.ndim:
            raise IndexError(f"{op}: mesh_dim: expected an axis in [0, {self.ndim}), got "
                             f"{mesh_dim}")
        return mesh_dim % self.ndim

    # -- slicing and flattening ------------------------------------------------------------
    def __getitem__(self, names: str | tuple[str, ...]) -> DeviceMesh:
        """The sub-mesh of the named axes that contains this rank (no new groups)."""
        sel = (names,) if isinstance(names, str) else tuple(names)
        if not sel or not all(isinstance(n, str) for n in sel):
            raise KeyError(f"DeviceMesh[...]: expected axis names, got {names!r}")
        if self._names is not None and sel == self._names:
            return self
        root = self._root
        axes = [self._resolve_name(n) for n in sel]
        flat = [a for group in axes for a in group]
        if len(set(flat)) != len(flat):
            raise KeyError(f"DeviceMesh[...]: axes {sel} overlap")
        return root._submesh(axes, sel)

    def _resolve_name(self, name: str) -> Axes:
        root = self._root
        if self._names and name in self._names:
            return self._axes[self._names.index(name)]
        if name in root._flat_names:
            return root._flat_names[name]
        if root._names and name in root._names:
            return (root._names.index(name),)
        known = list(self._names or ()) + list(root._flat_names)
        raise KeyError(f"DeviceMesh[...]: expected one of the axis names {known}, got {name!r}")

    def _submesh(self, axes: list[Axes], names: tuple[str, ...]) -> DeviceMesh:
        if self._coord is None:
            raise ValueError(f"DeviceMesh[...]: rank {self._world_rank} is not part of {self!r} "
                             f"(ranks {self._ranks_list})")
        chosen = [a for group in axes for a in group]
        index = tuple(slice(None) if a in chosen else self._coord[a] for a in range(self.ndim))
        kept = sorted(chosen)
        sub = self._mesh[index].permute([kept.index(a) for a in chosen])
        ranks = sub.reshape([math.prod(self.shape[a] for a in group) for group in axes]).clone()
        groups = tuple(self._root_groups[g[0]] if len(g) == 1 else self._flat[g] for g in axes)
        mesh = DeviceMesh.__new__(DeviceMesh)
        mesh._setup(self._device_type, ranks, names, self, tuple(axes), groups,
                    _coordinate_of(ranks, self._world_rank), self._world_rank)
        return mesh

    def _flatten(self, mesh_dim_name: str | None = None) -> DeviceMesh:
        """A 1-d mesh merging all axes of this mesh (collective: every rank calls it, same order).

        The name becomes usable on the root mesh too (``root["dp_cp"]``).
        """
        root = self._root
        axes: Axes = tuple(a for group in self._axes for a in group)
        name = mesh_dim_name or "_".join(self._names or (str(a) for a in axes))
        if root._names and name in root._names:
            raise ValueError(f"_flatten: mesh_dim_name: {name!r} already names an axis of {root!r}")
        if name in root._flat_names and root._flat_names[name] != axes:
            raise ValueError(f"_flatten: mesh_dim_name: {name!r} already names the flattened axes "
                             f"{root._flat_names[name]}")
        if len(axes) == 1:
            return root._submesh([axes], (name,))
        if axes not in root._flat:
            w = _world.current_world()
            root._flat[axes] = _axis_groups(root._mesh, [axes], w, [name])[0]
        root._flat_names[name] = axes
        return root._submesh([axes], (name,))

    # -- the current mesh -------------------------------------------------------------------
    def __enter__(self) -> Self:
        """``with mesh:`` makes this the mesh that ``parallelize_module``, ``distribute_tensor``,
        ``distribute_module``, ``DTensor.from_local`` and the DTensor factories use when given
        none (see :func:`current_mesh`); contexts nest, per thread."""
        _CURRENT.set(_CURRENT.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _CURRENT.get()
        if not stack or stack[-1] is not self:
            raise AssertionError(f"DeviceMesh.__exit__: {self!r} is not the innermost active mesh "
                                 f"(active: {list(stack)})")
        _CURRENT.set(stack[:-1])

    # -- identity, printing, pickling --------------------------------------------------------
    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return (self._hash == other._hash and self._device_type == other._device_type
                and self._names == other._names and self.shape == other.shape
                and bool(torch.equal(self._mesh, other._mesh)))

    def __hash__(self) -> int:
        return self._hash

    def __repr__(self) -> str:
        """As torch prints a mesh: ``DeviceMesh((dp=2, tp=4), 'cpu', stride=(4, 1))``, the ranks
        added under ``RINGLET_DEBUG=DETAIL`` (``..., Mesh: [[0, 1, 2, 3], [4, 5, 6, 7]])``)."""
        shape = self.shape
        dims = (f"({', '.join(f'{n}={s}' for n, s in zip(self._names, shape))})"
                if self._names else str(shape))
        text = f"DeviceMesh({dims}, '{self._device_type}', stride={self._layout_strides()}"
        if _debug_detail():
            text += f", Mesh: {self._ranks_list}"
        return text + ")"

    def _layout_strides(self) -> tuple[Any, ...]:
        """Each axis's step between neighbouring positions in the root mesh (row-major, as
        torch's mesh layout counts them): one number, or a tuple of one per root axis where a
        flattened axis's root axes do not merge into one step; an axis of size 1 has ``()``."""
        root_shape = self._root.shape
        steps = [math.prod(root_shape[a + 1:]) for a in range(len(root_shape))]
        out: list[Any] = []
        for group in self._axes:
            modes: list[tuple[int, int]] = []          # (size, step), size-1 axes left out
            for a in group:
                size, step = root_shape[a], steps[a]
                if size == 1:
                    continue
                if modes and modes[-1][1] == size * step:
                    modes[-1] = (modes[-1][0] * size, step)
                else:
                    modes.append((size, step))
            strides = tuple(step for _, step in modes)
            out.append(strides[0] if len(strides) == 1 else strides)
        return tuple(out)

    def __reduce__(self) -> tuple[Any, ...]:
        # [Note: DTensor pickling] lives in ringlet/dtensor/_api.py; a mesh travels as its layout.
        return (restore_mesh, (self._device_type, self._mesh.tolist(), self._names))

    def __deepcopy__(self, memo: dict[int, Any]) -> DeviceMesh:
        return self      # a mesh owns process groups: copies of a model share it

    def __copy__(self) -> DeviceMesh:
        return self


_CURRENT: contextvars.ContextVar[tuple[DeviceMesh, ...]] = contextvars.ContextVar(
    "ringlet_current_mesh", default=())


def _debug_detail() -> bool:
    try:
        return _env.debug_level() == "DETAIL"
    except ValueError:          # a bad RINGLET_DEBUG is reported where it matters, not in a repr
        return False


def current_mesh() -> DeviceMesh | None:
    """The innermost mesh of an active ``with mesh:`` block of this thread, or ``None``."""
    stack = _CURRENT.get()
    return stack[-1] if stack else None


def restore_mesh(device_type: str, ranks: list[Any], names: tuple[str, ...] | None) -> DeviceMesh:
    """Reattach a pickled mesh to the current world (policy in docs/dtensor.md, "Saving").

    The mesh must have been built in this world already (it, or a root it is a slice or
    flattening of); a 1-d mesh of the whole world in rank order is rebuilt on the default
    group.  Building groups here is not an option: unpickling is not collective.
    """
    w = _world.current_world(required=False)
    if w is None:
        raise ValueError("torch.load of a DTensor: expected an initialized process group (the "
                         "DTensor's DeviceMesh is reattached to the current world), got none; call "
                         "init_process_group and build the mesh first")
    found = _registry.find(w, device_type, ranks, names)
    if found is not None:
        return found
    if list(ranks) == list(range(w.world_size)):
        return DeviceMesh.from_group(w.default_pg, device_type, mesh_dim_names=names)
    raise ValueError(f"torch.load of a DTensor: expected DeviceMesh({device_type}, {ranks}, "
                     f"names={names}) to exist in this world, got none; build it (init_device_mesh "
                     "/ DeviceMesh) on every rank before loading")


def init_device_mesh(device_type: str, mesh_shape: tuple[int, ...] | list[int], *,
                     mesh_dim_names: tuple[str, ...] | None = None) -> DeviceMesh:
    """A mesh of shape ``mesh_shape`` over the ranks ``0 .. world_size - 1`` in row-major order.

    Every rank calls it (it creates the axis groups).

    Raises:
        ValueError: the shape's product differs from the world size, or bad names / device type.

    Example::

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))   # 4 ranks
    """
    _check_device_type(device_type)
    w = joined_world(device_type)
    shape = tuple(int(s) for s in mesh_shape)
    if not shape or any(s <= 0 for s in shape) or math.prod(shape) != w.world_size:
        raise ValueError("init_device_mesh: mesh_shape: expected positive sizes whose product is "
                         f"the world size {w.world_size}, got {tuple(mesh_shape)}")
    return DeviceMesh(device_type, torch.arange(w.world_size).reshape(shape),
                      mesh_dim_names=mesh_dim_names)


def joined_world(device_type: str) -> Any:
    """The default group's world, joining it first if this process has not (torch's meshes do
    the same): ``init_process_group()`` from the launcher's environment (``env://``), with
    ``"nccl"`` for a CUDA mesh (CUDA tensors on NCCL, CPU ones on ringlet's transport).  A CUDA
    mesh also picks this process's GPU, ``LOCAL_RANK`` (else the rank) modulo the GPUs of the
    host, unless CUDA is already in use here (then the caller chose)."""
    w = _world.current_world(required=False)
    if w is None:
        _world.init_process_group("nccl" if device_type == "cuda" else None)
        w = _world.current_world()
    if device_type == "cuda" and not torch.cuda.is_initialized():
        local = int(os.environ.get("LOCAL_RANK", w.rank))
        torch.cuda.set_device(local % torch.cuda.device_count())
    return w


def compute_device(mesh: DeviceMesh | object) -> torch.device:
    """The device the ranks of ``mesh`` compute on: its type (``cuda``: the current CUDA device,
    which ``init_process_group(device_id=...)`` or ``torch.cuda.set_device`` chose).

    DTensor and ``fully_shard`` put tensors that are not there yet on this device, as torch does.
    """
    kind = str(getattr(mesh, "device_type", "cpu"))   # a mesh-like object without one: CPU
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _check_device_type(device_type: str) -> None:
    if device_type == "cpu" or (device_type == "cuda" and torch.cuda.is_available()):
        return
    raise ValueError("DeviceMesh: device_type: expected "
                     f"'cpu'{' or cuda' if torch.cuda.is_available() else ''}, got {device_type!r}")


def _as_rank_tensor(mesh: Any, world_size: int) -> torch.Tensor:
    ranks = mesh.detach().cpu() if isinstance(mesh, torch.Tensor) else torch.tensor(mesh)
    if (ranks.is_floating_point() or ranks.dtype == torch.bool or ranks.dim() == 0
            or ranks.numel() == 0):
        raise ValueError("DeviceMesh: mesh: expected a non-empty nested list or tensor of "
                         f"integer ranks, got {mesh!r}")
    ranks = ranks.to(torch.int64).contiguous()
    flat = ranks.flatten().tolist()
    if len(set(flat)) != len(flat) or min(flat) < 0 or max(flat) >= world_size:
        raise ValueError("DeviceMesh: mesh: expected distinct ranks in [0, "
                         f"{world_size}), got {ranks.tolist()}")
    return ranks


def _check_names(names: Any, ndim: int) -> tuple[str, ...] | None:
    if names is None:
        return None
    names = tuple(names)
    if len(names) != ndim or len(set(names)) != ndim or not all(isinstance(n, str) for n in names):
        raise ValueError(f"DeviceMesh: mesh_dim_names: expected {ndim} "
                         f"distinct names, got {names!r}")
    return names


def _coordinate_of(ranks: torch.Tensor, rank: int) -> tuple[int, ...] | None:
    where = (ranks == rank).nonzero()
    return None if where.numel() == 0 else tuple(int(c) for c in where[0])


def _axis_groups(ranks: torch.Tensor, axes_list: list[Axes], w: Any,
                 labels: list[str]) -> list[ProcessGroup | None]:
    """For each entry of ``axes_list``: the group of this rank along those axes (None: not in
    the mesh).  Every rank creates every line's group, as one group creation of the world
    ([Note: group creation] in ringlet/c10d/_creation.py); a line that is the whole world in rank
    order reuses the default group."""
    lines_per: list[list[list[int]]] = []
    for axes in axes_list:
        others = [a for a in range(ranks.dim()) if a not in axes]
        size = math.prod(ranks.shape[a] for a in axes)
        lines_per.append(ranks.permute(others + list(axes)).reshape(-1, size).tolist())
    world = list(range(w.world_size))
    new = [(i, line) for i, lines in enumerate(lines_per) for line in lines if line != world]
    made = _world.create_groups([sorted(line) for _, line in new], None, None,
                                [f"mesh[{labels[i]}]{line}" for i, line in new],
                                what=f"DeviceMesh({ranks.tolist()})") if new else []
    mine: list[ProcessGroup | None] = [
        w.default_pg if [world] == lines else None for lines in lines_per]
    for (i, line), g in zip(new, made, strict=True):
        if w.rank in line:
            mine[i] = g
    return mine
