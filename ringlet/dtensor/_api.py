"""``DTensor``: a ``torch.Tensor`` subclass that holds one rank's piece of a global tensor.

A DTensor is a wrapper tensor (``_make_wrapper_subclass``) whose size, stride and
dtype are the *global* tensor's; the data lives in ``_local_tensor`` and the layout
in ``_spec`` (mesh + one placement per mesh axis).  Operators reach
``__torch_dispatch__`` below autograd, where ``_dispatch`` applies a sharding rule
to the local tensors; autograd therefore sees DTensors only, and gradients of
DTensor parameters are DTensors.

[Note: DTensor pickling]
A DTensor pickles as its local tensor, placements, global shape and stride, and its
mesh's layout (device type, ranks, axis names).  Unpickling reattaches the mesh to the
*current* world: it must already exist there (built by ``init_device_mesh`` or
``DeviceMesh``, or sliced / flattened from such a mesh), except a 1-d mesh of the
whole world in rank order, which is rebuilt on the default group.  Each rank thus
loads the file it saved, on a world with the same layout; resharding to another
layout is the checkpoint layer's job.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence
from typing import Any, Self

import torch

from ringlet.dtensor import _shard_math
from ringlet.dtensor._redistribute import redistribute_local
from ringlet.dtensor._spec import DTensorSpec, Placements, format_spec, normalize_placements
from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard
from ringlet.mesh import DeviceMesh
from ringlet.mesh.device_mesh import compute_device

__all__ = ["DTensor", "default_mesh", "distribute_tensor", "make_dtensor", "resolve_lazy",
           "wrap_local"]


class DTensor(torch.Tensor):
    """A global tensor laid out over a :class:`DeviceMesh` by placements (``Shard``,
    ``Replicate``, ``Partial``), one per mesh axis.  Prints as ``DTensor(f32[8@tp,4] S(0))``.

    Build one with :func:`distribute_tensor` (split a full tensor) or :meth:`from_local`
    (wrap each rank's piece); read it with :meth:`to_local` or :meth:`full_tensor`;
    change its layout with :meth:`redistribute`.  torch operators work on DTensors
    (see docs/dtensor.md for the sharding rules); gradients flow through all of these.
    """

    _local_tensor: torch.Tensor
    _spec: DTensorSpec

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool) -> Self:
        if isinstance(local_tensor, DTensor):
            raise TypeError("DTensor: local_tensor: expected a torch.Tensor, got a DTensor")
        if local_tensor.is_conj() or local_tensor.is_neg():   # [Note: lazy conjugate and negative]
            local_tensor = resolve_lazy(local_tensor)
        r = torch.Tensor._make_wrapper_subclass(
            cls, spec.shape, strides=spec.stride, dtype=local_tensor.dtype,
            device=local_tensor.device, layout=local_tensor.layout, requires_grad=requires_grad)
        r._local_tensor = local_tensor
        r._spec = spec
        return r

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple[Any, ...] = (),  # type: ignore[override]
                           kwargs: dict[str, Any] | None = None) -> Any:
        # Replaced by ``_dispatch.torch_dispatch`` when that module loads (``ringlet.dtensor``
        # imports it): the dispatcher needs this class, so this module cannot import it.
        raise AssertionError(f"DTensor: {func}: the dispatcher (ringlet.dtensor._dispatch) is not "
                             "loaded; import ringlet.dtensor")

    # -- layout ---------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @property
    def placements(self) -> Placements:
        return self._spec.placements

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return format_spec(self._spec, self.dtype)

    def __str__(self) -> str:
        return self.__repr__()

    def verbose_repr(self) -> str:
        """The long form, with this rank's local tensor: ``DTensor(local_tensor=..., ...)``."""
        return (f"DTensor(local_tensor={self._local_tensor}, device_mesh={self.device_mesh!r}, "
                f"placements={list(self.placements)})")

    # -- conversions ------------------------------------------------------------------------
    @staticmethod
    def from_local(local_tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                   placements: Sequence[Placement] | None = None, *, run_check: bool = False,
                   shape: Sequence[int] | None = None, stride: Sequence[int] | None = None,
                   grad_placements: Sequence[Placement] | None = None) -> DTensor:
        """Wrap this rank's piece ``local_tensor`` of a global tensor (no communication by default).

        Args:
            local_tensor: this rank's shard (``Shard``), copy (``Replicate``) or partial
                value (``Partial``).
            device_mesh: the mesh (default: a 1-d mesh of the whole world).
            placements: one per mesh axis (default: all ``Replicate``).
            run_check: check across ranks that the local shapes and dtypes fit together
                (one all-gather per axis) and copy the first rank's value along
                ``Replicate`` axes (a broadcast).
            shape, stride: the global shape and stride; needed when shards are uneven
                (default: shards assumed even, ``local size x axis size``).
            grad_placements: the placements ``local_tensor``'s gradient is taken from: the
                DTensor gradient is redistributed to them before it becomes the local
                gradient.  Default: ``placements`` with ``Partial`` read as ``Replicate``.
                ``Partial`` here skips the reduction: each rank's gradient is then its own
                partial value (for a caller that reduces it later, e.g. once per step).

        Raises:
            ValueError: bad placements, or (``run_check``) shards that do not fit.

        Example::

            dt = DTensor.from_local(torch.ones(2, 4), mesh, [Shard(0)])   # 2 ranks: [4, 4]
        """
        mesh = device_mesh if device_mesh is not None else default_mesh()
        local_tensor = on_mesh_device(local_tensor, mesh)
        return wrap_local(local_tensor, mesh, placements, run_check=run_check, shape=shape,
                          stride=stride, grad_placements=grad_placements)

    def to_local(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """This rank's local tensor (shares storage); its gradient becomes a DTensor with
        ``grad_placements`` (default: this DTensor's placements)."""
        pls = None if grad_placements is None else normalize_placements(
            grad_placements, self.device_mesh, self.dim(), "to_local")
        return _ToLocal.apply(self, pls)

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        """The whole global tensor on every rank (redistributes to Replicate, then ``to_local``)."""
        full = self.redistribute(self.device_mesh, [Replicate()] * self.device_mesh.ndim)
        return full.to_local(grad_placements=grad_placements)

    def redistribute(self, device_mesh: DeviceMesh | None = None,
                     placements: Sequence[Placement] | None = None, *, async_op: bool = False,
                     forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        """The same global value laid out by ``placements`` (collectives per ``_redistribute``).

        Every transition is supported on every axis: S->R all-gather, R->S local chunk,
        P->R all-reduce, P->S reduce-scatter, S(i)->S(j) all-to-all, R->P partition.
        The gradient takes the inverse path (a ``Partial`` source gets a ``Replicate``
        gradient).  ``async_op`` is accepted for torch compatibility; ringlet runs the
        transition before returning.

        Raises:
            ValueError: another mesh (use ``full_tensor`` + ``distribute_tensor`` to move
                between meshes), or placements that do not fit.
        """
        mesh = self.device_mesh if device_mesh is None else device_mesh
        if mesh != self.device_mesh:
            raise ValueError(f"redistribute: device_mesh: expected {self.device_mesh!r} (this "
                             f"DTensor's mesh), got {mesh!r}")
        if placements is None:
            raise ValueError("redistribute: placements: expected one "
                             "placement per mesh axis, got None")
        pls = normalize_placements(placements, mesh, self.dim(), "redistribute")
        out: DTensor = _Redistribute.apply(self, pls, forward_dtype, backward_dtype)
        return out

    # -- copying and pickling ([Note: DTensor pickling]) ------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> DTensor:
        if id(self) in memo:
            return memo[id(self)]
        if not self.is_leaf:
            raise RuntimeError("deepcopy of a DTensor: expected a graph leaf (like torch.Tensor), "
                               "got a tensor with a grad_fn")
        new = DTensor(copy.deepcopy(self._local_tensor, memo), self._spec,
                      requires_grad=self.requires_grad)
        if getattr(self, "_is_param", False):
            new._is_param = True
        memo[id(self)] = new
        return new

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        s = self._spec
        return (_rebuild_dtensor, (self._local_tensor.detach(), s.mesh, s.placements, s.shape,
                                   s.stride, self.requires_grad,
                                   bool(getattr(self, "_is_param", False))))

    def __tensor_flatten__(self) -> tuple[list[str], tuple[DTensorSpec, bool]]:
        return ["_local_tensor"], (self._spec, self.requires_grad)

    def _stable_hash_for_caching(self) -> str:
        """torch.compile's cache key for this DTensor: its layout, its local piece and *this
        rank* (a compiled graph may hold rank-specific constants, so ranks never share a cached
        graph; [Note: traceable collectives] in ``_traceable.py``)."""
        s, mesh, local = self._spec, self._spec.mesh, self._local_tensor
        groups = [getattr(g, "group_name", None) for g in getattr(mesh, "_groups", ())]
        payload = repr((tuple(s.shape), tuple(s.stride), tuple(map(str, s.placements)),
                        str(self.dtype), self.device.type, self.requires_grad,
                        tuple(local.shape), tuple(local.stride()), mesh.device_type,
                        getattr(mesh, "_ranks_list", None), mesh.mesh_dim_names,
                        mesh.get_coordinate(), getattr(mesh, "_world_rank", None), groups))
        return hashlib.blake2b(payload.encode(), digest_size=16).hexdigest()

    def __coerce_same_metadata_as_tangent__(self, expected: tuple[DTensorSpec, bool],
                                            expected_type: Any = None) -> DTensor | None:
        """torch.compile's AOT autograd: the gradient fed to a compiled backward must have the
        layout it was traced with; redistribute it there (``None``: not a DTensor wanted)."""
        if expected_type is not None:
            return None
        spec = expected[0]
        if spec.placements == self._spec.placements:
            return self
        return self.redistribute(spec.mesh, spec.placements)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: tuple[DTensorSpec, bool],
                             outer_size: Any, outer_stride: Any) -> DTensor:
        spec, requires_grad = ctx
        return DTensor(inner["_local_tensor"], spec, requires_grad=requires_grad)


def resolve_lazy(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its lazy conjugate and negative bits applied (a new tensor when either is set).

    [Note: lazy conjugate and negative]
    torch marks ``x.conj()`` and ``x._neg_view()`` (and views of them, such as ``.imag`` of a
    conjugate) with a flag instead of computing them; kernels read the flag.  A DTensor's
    wrapper does not carry its local tensor's flags, and the local tensors reach the kernels
    below the wrapper's dispatch, where the flags would be lost or applied twice.  So no
    DTensor ever holds a flagged local tensor: every constructor (``DTensor.__new__``, hence
    ``from_local``, ``distribute_tensor`` and the dispatcher's uncached path) resolves it here,
    the rules of ``_conj``/``_neg_view`` compute the value (``ringlet/dtensor/_ops/pointwise.py``),
    and a cached decision whose op returned a flagged tensor resolves its output every time
    (``_decide``).  The hot path (``_dispatch.wrap_local``) therefore needs no check.
    """
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def _rebuild_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: Placements,
                     shape: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool,
                     is_param: bool) -> torch.Tensor:
    dt = DTensor(local, DTensorSpec(mesh, tuple(placements), tuple(shape), tuple(stride)),
                 requires_grad=requires_grad)
    if is_param:
        return torch.nn.Parameter(dt, requires_grad=requires_grad)
    return dt


def serialization_globals() -> list[Any]:
    """The globals ``torch.load(..., weights_only=True)`` must allow to rebuild DTensors.

    Only for files you trust (a DTensor file names a mesh layout that is looked up in
    the current world; nothing else is executed)::

        with torch.serialization.safe_globals(serialization_globals()):
            sd = torch.load(path)
    """
    from ringlet.dtensor.placements import _NormPartial, _StridedShard
    from ringlet.mesh.device_mesh import restore_mesh

    return [_rebuild_dtensor, restore_mesh, Shard, Replicate, Partial, _NormPartial, _StridedShard]


def make_dtensor(local: torch.Tensor, mesh: DeviceMesh, placements: Placements,
                 shape: Sequence[int], stride: Sequence[int] | None = None) -> DTensor:
    """A DTensor from parts, no checks and no autograd (for rules and strategies)."""
    st = tuple(stride) if stride is not None else _shard_math.strides_like(local, shape)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tuple(shape), st),
                   requires_grad=False)


def default_mesh() -> DeviceMesh:
    """What ``device_mesh=None`` means: the mesh of the innermost ``with mesh:`` block of this
    thread, else a 1-d mesh over the whole world, on the default group."""
    from ringlet.c10d import world as _world
    from ringlet.mesh.device_mesh import current_mesh

    active = current_mesh()
    if active is not None:
        return active
    w = _world.current_world()
    if w is None or w.default_pg is None:  # pragma: no cover - current_world raised
        raise AssertionError("no world")
    return DeviceMesh.from_group(w.default_pg, "cpu")


def on_mesh_device(t: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``t`` on the device ``mesh`` computes on: a tensor of another device type is copied
    there (a CPU tensor given to a CUDA mesh goes to the current CUDA device); ``meta`` tensors
    stay (deferred initialisation).  The copy is differentiable."""
    if t.device.type == mesh.device_type or t.is_meta:
        return t
    return t.to(compute_device(mesh))


def wrap_local(local: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement] | None,
               *, run_check: bool = False, shape: Sequence[int] | None = None,
               stride: Sequence[int] | None = None,
               grad_placements: Sequence[Placement] | None = None) -> DTensor:
    """:meth:`DTensor.from_local` with ``local`` left on its device: for pieces that live
    elsewhere than the mesh computes on by design (``fully_shard``'s shards offloaded to the CPU
    of a CUDA mesh, a checkpoint's values loaded into them)."""
    pls = normalize_placements(placements, mesh, local.dim(), "DTensor.from_local")
    if shape is None:
        gshape = list(local.shape)
        for axis, p in enumerate(pls):
            if isinstance(p, Shard):
                gshape[p.dim] *= mesh.shape[axis]
    else:
        gshape = [int(s) for s in shape]
    gstride = tuple(stride) if stride is not None else _shard_math.strides_like(local, gshape)
    spec = DTensorSpec(mesh, pls, tuple(gshape), gstride)
    if mesh.get_coordinate() is None:     # [Note: ranks outside the mesh] in ``_outside``
        local = local.new_empty(0, requires_grad=local.requires_grad)
    elif run_check:
        local = _check_local(local, spec)
    grad_pls = _grad_placements(pls) if grad_placements is None else normalize_placements(
        grad_placements, mesh, len(gshape), "DTensor.from_local")
    return _FromLocal.apply(local, spec, grad_pls)


def _grad_placements(pls: Placements) -> Placements:
    """Where the gradient of a value with placements ``pls`` is wanted: Partial -> Replicate.

    Every rank's partial contributes to the global value with coefficient 1, so each
    one's gradient is the whole upstream gradient.
    """
    return tuple(Replicate() if isinstance(p, Partial) else p for p in pls)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, spec: DTensorSpec,
                grad_pls: Placements) -> DTensor:
        ctx.spec = spec
        ctx.grad_pls = grad_pls
        return DTensor(local.detach(), spec, requires_grad=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
        spec: DTensorSpec = ctx.spec
        if not isinstance(grad, DTensor):
            return grad, None, None
        local = redistribute_local(grad._local_tensor, spec.mesh, grad.placements, ctx.grad_pls,
                                   grad._spec.shape)
        return local, None, None


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: DTensor, grad_placements: Placements | None) -> torch.Tensor:
        ctx.spec = (dt._spec if grad_placements is None
                    else dt._spec.with_placements(grad_placements))
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[DTensor, None]:
        spec: DTensorSpec = ctx.spec
        return DTensor(grad, spec, requires_grad=False), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, dt: DTensor, pls: Placements, fwd_dtype: torch.dtype | None,
                bwd_dtype: torch.dtype | None) -> DTensor:
        ctx.src = dt._spec
        ctx.bwd_dtype = bwd_dtype
        ctx.in_dtype = dt.dtype
        local = dt._local_tensor
        if fwd_dtype is not None and fwd_dtype != local.dtype:
            local = local.to(fwd_dtype)
        if pls == dt.placements and local is dt._local_tensor:
            local = local.view_as(local)     # a new DTensor object sharing the data, like torch
        else:
            local = redistribute_local(local, dt.device_mesh, dt.placements, pls, dt._spec.shape)
        return DTensor(local, DTensorSpec(dt.device_mesh, pls, dt._spec.shape,
                                          _shard_math.strides_like(local, dt._spec.shape)),
                       requires_grad=False)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None, None]:
        src: DTensorSpec = ctx.src
        if not isinstance(grad, DTensor):
            return grad, None, None, None
        local = grad._local_tensor
        if ctx.bwd_dtype is not None and local.dtype != ctx.bwd_dtype:
            local = local.to(ctx.bwd_dtype)
        want = _grad_placements(src.placements)
        local = redistribute_local(local, src.mesh, grad.placements, want, src.shape)
        if local.dtype != ctx.in_dtype:
            local = local.to(ctx.in_dtype)
        spec = DTensorSpec(src.mesh, want, src.shape, src.stride)
        return DTensor(local, spec, requires_grad=False), None, None, None


def distribute_tensor(tensor: torch.Tensor, device_mesh: DeviceMesh | None = None,
                      placements: Sequence[Placement] | None = None, *,
                      src_data_rank: int | None = 0) -> DTensor:
    """Split a full tensor over ``device_mesh`` by ``placements`` (a leaf DTensor).

    Args:
        tensor: the whole tensor, same shape on every rank.
        device_mesh: the mesh (default: a 1-d mesh of the whole world).
        placements: one per mesh axis (default: all ``Replicate``).
        src_data_rank: the mesh coordinate (along every axis) whose ``tensor`` is the
            source; its data is broadcast first, so ranks may pass different values.
            ``None``: every rank uses its own ``tensor`` (no communication).

    Returns:
        A DTensor with ``requires_grad`` as ``tensor``'s, detached from its graph.

    Raises:
        ValueError: bad placements; a DTensor on another mesh or with other placements.

    Example::

        w = distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)])
    """
    mesh = device_mesh if device_mesh is not None else default_mesh()
    pls = normalize_placements(placements, mesh, tensor.dim(), "distribute_tensor")
    if isinstance(tensor, DTensor):
        if tensor.device_mesh != mesh or tensor.placements != pls:
            raise ValueError("distribute_tensor: tensor: expected a torch.Tensor or a DTensor on "
                             f"{mesh!r} with {list(pls)}, got {tensor!r} on "
                             f"{tensor.device_mesh!r}; use redistribute")
        return tensor
    spec = DTensorSpec(mesh, pls, tuple(tensor.shape), _shard_math.contiguous_strides(tensor.shape))
    coord = mesh.get_coordinate()
    if coord is None:            # torch's placeholder ([Note: ranks outside the mesh])
        local = on_mesh_device(tensor.detach().new_empty(0), mesh)
        return DTensor(local, spec, requires_grad=tensor.requires_grad)
    local = on_mesh_device(tensor.detach(), mesh)
    fresh = local.device != tensor.device     # local is a buffer of our own (a copy, a broadcast)
    if src_data_rank is not None and not local.is_meta:   # meta: no data to agree on
        from ringlet.dtensor import _comm

        for axis in range(mesh.ndim):
            if not 0 <= src_data_rank < mesh.shape[axis]:
                raise ValueError(f"distribute_tensor: src_data_rank: expected a coordinate in "
                                 f"[0, {mesh.shape[axis]}) of axis {axis}, got {src_data_rank}")
            if mesh.shape[axis] > 1:
                local = _comm.broadcast(local, mesh, axis, src_data_rank)
                fresh = True
    for axis in _shard_math.shard_order(pls):
        local = pls[axis].local_chunk(local, mesh.shape[axis], coord[axis])  # type: ignore[attr-defined]
        fresh = False          # a view of the whole tensor: copy it so that the whole can be freed
    for axis, p in enumerate(pls):
        if isinstance(p, Partial):
            local = p.partition(local, coord[axis])
    if not fresh:
        local = local.clone(memory_format=torch.contiguous_format)
    return DTensor(local, spec, requires_grad=tensor.requires_grad)


def _check_local(local: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """``from_local(run_check=True)``: shards must fit the global shape;
    replicas follow coordinate 0."""
    from ringlet.dtensor import _comm

    mesh = spec.mesh
    want = spec.local_shape()
    if list(local.shape) != want:
        raise ValueError(f"DTensor.from_local: rank {mesh.get_rank()}: expected a local tensor of "
                         f"shape {want} for global shape {list(spec.shape)} with "
                         f"{list(spec.placements)}, got {list(local.shape)}")
    probe = torch.tensor([_DTYPE_CODES.get(local.dtype, -1)] + list(spec.shape), dtype=torch.int64,
                         device=local.device)
    for axis in range(mesh.ndim):
        sizes = [1] * mesh.shape[axis]
        seen = _comm.all_gather(probe.unsqueeze(0), mesh, axis, 0, sizes)
        if not bool((seen == probe).all()):
            raise ValueError(f"DTensor.from_local: ranks along mesh axis {axis} disagree on dtype "
                             f"or global shape: {seen.tolist()} (dtype code, shape...)")
    for axis, p in enumerate(spec.placements):
        if isinstance(p, Replicate) and mesh.shape[axis] > 1:
            local = _comm.broadcast(local, mesh, axis, 0)
    return local


_DTYPE_CODES = {dt: i for i, dt in enumerate([
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128])}
