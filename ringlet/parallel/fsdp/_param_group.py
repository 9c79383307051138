"""One fully_shard call's parameter group: residency, the flat all-gather
and the gradient reduction.

The group owns two flat buffers ([Note: flat layouts] in ``_shard_math``): the *shard
buffer* (this rank's padded shards, in the parameters' own dtype; the sharded DTensors'
local tensors are views into it, [Note: aliasing] in ``_param``) and the *unsharded buffer*
(every unsharded parameter, in the compute dtype).  ``unshard`` fills the unsharded buffer
with one ``all_gather_into_tensor``; ``reshard`` frees it by resizing its storage to 0.
``post_backward`` reduce-scatters every gradient with one ``reduce_scatter_tensor`` (and, for
HSDP, one ``all_reduce``) and adds the result into the sharded ``.grad`` DTensors.

[Note: resharding to a smaller group]
``reshard_after_forward=k`` (``1 < k < N`` dividing the shard world size ``N``): shard ranks
form groups of ``k`` consecutive ranks (``_mesh_info.subgroups``).  When a forward unshards, each
rank also keeps block ``j`` (its rank in its ``k``-group) of the rank-major gathered buffer,
``N / k`` shards long: the *post-forward shard*.  After forward the unsharded parameters are
freed as usual (the sharded ones are registered), and the backward unshard all-gathers the
post-forward shards over the ``k``-group, whose blocks make up the whole rank-major buffer: a
smaller, faster all-gather for ``1/k`` of the unsharded memory kept.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from ringlet.dtensor import DTensor
from ringlet.parallel.fsdp import _collectives as fsdp_comm
from ringlet.parallel.fsdp._device import ShardHome
from ringlet.parallel.fsdp._mesh_info import MeshInfo
from ringlet.parallel.fsdp._param import FSDPParam
from ringlet.parallel.fsdp._shard_math import GroupLayout
from ringlet.parallel.fsdp.policies import MixedPrecisionPolicy

__all__ = ["FSDPParamGroup", "ShardedState"]


class ShardedState(enum.Enum):
    """Which parameters are registered on the modules: the sharded DTensors
    or the unsharded views."""

    SHARDED = "sharded"
    UNSHARDED = "unsharded"


class FSDPParamGroup:
    """The parameters of one ``fully_shard(module)`` call and their collectives."""

    def __init__(self, module: nn.Module, params: list[FSDPParam], layout: GroupLayout,
                 shard_buffer: torch.Tensor, mesh_info: MeshInfo,
                 mp_policy: MixedPrecisionPolicy, home: ShardHome | None = None) -> None:
        self.module = module
        # compute device and where the shards live ([Note: FSDP devices] in _device.py)
        self.home = home or ShardHome(shard_buffer.device, None)
        self.params = params
        self.layout = layout
        self.shard_buffer = shard_buffer          # flat, padded, this rank's shards (orig dtype)
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        self.sharded_state = ShardedState.SHARDED
        # flat, param-major; storage size 0 when freed
        self._unsharded: torch.Tensor | None = None
        self._unsharded_alias: torch.Tensor | None = None  # same storage, own version counter
        self._pending_unshard: fsdp_comm.AllGather | None = None
        self._pending_reduce: fsdp_comm.ReduceScatter | None = None
        # reduced shards on their way to the CPU (offload): (shards, params with grads, copy)
        self._landing: list[tuple[torch.Tensor, list[int], Any]] = []
        self.pool = fsdp_comm.BufferPool()     # replaced by the root's shared pool at lazy init
        # HSDP: reduce-scattered, not yet all-reduced
        self._partial_reduce: torch.Tensor | None = None
        self._partial_with_grad: set[int] = set()
        # Controls (FSDPModule setters).
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.requires_all_reduce = True
        self.unshard_in_backward = True
        self.divide_factor: float | None = None
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.comm = fsdp_comm.CommOptions()
        self.reduce_scatter_unused_params = False
        self.unshard_async_op = False
        self.allocate_from_process_group = False
        # [Note: resharding to a smaller group]
        self._post_forward_shard: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (f"FSDPParamGroup({type(self.module).__name__}, {len(self.params)} params, "
                f"{self.sharded_state.value}, {self.mesh_info!r})")

    def __deepcopy__(self, memo: dict[int, Any]) -> FSDPParamGroup:
        """Copy the sharded state; see [Note: copying a fully_shard module] in ``_api.py``."""
        if self._pending_unshard is not None or self._pending_reduce is not None or \
                self._landing or self.sharded_state is not ShardedState.SHARDED:
            raise AssertionError(f"deepcopy of {self!r}: expected a resharded group with no "
                                 "collective in flight (FSDPModule.__deepcopy__ prepares it)")
        new = FSDPParamGroup.__new__(FSDPParamGroup)
        memo[id(self)] = new
        fresh = {"_unsharded": None, "_unsharded_alias": None}   # freed storage: never copied
        for k, v in self.__dict__.items():
            new.__dict__[k] = fresh[k] if k in fresh else copy.deepcopy(v, memo)
        return new

    # -- dtypes ----------------------------------------------------------------------------
    @property
    def orig_dtype(self) -> torch.dtype:
        return self.shard_buffer.dtype

    @property
    def param_dtype(self) -> torch.dtype:
        return self.mp_policy.param_dtype or self.orig_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.mp_policy.reduce_dtype or self.param_dtype

    # -- residency -------------------------------------------------------------------------
    def _transition(self, expected: ShardedState, new: ShardedState, what: str) -> None:
        if self.sharded_state is not expected:
            raise AssertionError(f"fully_shard({type(self.module).__name__}): {what}: expected "
                                 f"sharded state {expected.value}, got {self.sharded_state.value}")
        self.sharded_state = new

    def unshard(self, async_op: bool = False) -> bool:
        """All-gather the group (idempotent).  Returns True if an all-gather is now in flight."""
        if self.sharded_state is ShardedState.UNSHARDED:
            return False
        if self._pending_unshard is None:
            self._sync_registration()
            if self.shard_buffer.device.type == "meta":
                raise RuntimeError(f"fully_shard({type(self.module).__name__}): expected "
                                   "materialised parameters, got parameters on the meta device; "
                                   f"call module.to_empty(device='{self.home.device.type}') and "
                                   "initialise them (e.g. reset_parameters()) first")
            pf = self._post_forward_shard
            if pf is not None and self.comm.post_forward_pg is not None:
                self._pending_unshard = fsdp_comm.start_all_gather(
                    pf, self.param_dtype, self.layout, self.comm.post_forward_pg, async_op,
                    self.pool, device=self.home.device)
            else:
                self._pending_unshard = fsdp_comm.start_all_gather(
                    self.shard_buffer, self.param_dtype, self.layout, self.mesh_info.shard_group,
                    async_op, self.pool, self.comm.all_gather_comm, device=self.home.device)
        if async_op:
            return True
        self.wait_for_unshard()
        return False

    def wait_for_unshard(self) -> None:
        """Finish a pending all-gather: copy out and register the unsharded parameters."""
        ag = self._pending_unshard
        if ag is None:
            return
        self._pending_unshard = None
        unsharded = self._alloc_unsharded()
        pf_pg = self.comm.post_forward_pg
        keep = None
        if pf_pg is not None and self._post_forward_shard is None:
            block = self.layout.gathered_numel // pf_pg.size()
            keep = (pf_pg.rank() * block, (pf_pg.rank() + 1) * block)
        kept = fsdp_comm.finish_all_gather(ag, unsharded, self.layout, self.pool,
                                           self.shard_buffer, keep)
        self._post_forward_shard = kept if kept is not None else self._post_forward_shard
        self._transition(ShardedState.SHARDED, ShardedState.UNSHARDED, "unshard")
        for p in self.params:
            p.register(p.unsharded_param)  # type: ignore[arg-type]

    def reshard(self, post_forward: bool = False) -> None:
        """Register the sharded parameters and free the unsharded buffer (idempotent).

        ``post_forward``: keep the post-forward shard for the backward all-gather, if there is
        one ([Note: resharding to a smaller group]); otherwise it is dropped too.
        """
        if self._pending_unshard is not None:
            ag, self._pending_unshard = self._pending_unshard, None
            # nobody waited for it: let it finish
            fsdp_comm.wait_all_gather(ag, self.pool, self.shard_buffer)
            if ag.pooled:
                self.pool.give(ag.gathered)
        if not post_forward:
            self._post_forward_shard = None
        if self.sharded_state is ShardedState.SHARDED:
            return
        self._transition(ShardedState.UNSHARDED, ShardedState.SHARDED, "reshard")
        for p in self.params:
            p.register(p.sharded_param)
        if self._unsharded is not None:
            self._unsharded.untyped_storage().resize_(0)

    def _alloc_unsharded(self) -> torch.Tensor:
        """The unsharded buffer's writable alias, (re)allocated in place if it was freed."""
        buf = self._unsharded
        dtype, device = self.param_dtype, self.home.device
        if buf is None or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(self.layout.unsharded_numel, dtype=dtype, device=device)
            self._unsharded, self._unsharded_alias = buf, buf.data
            for p in self.params:
                p.bind_unsharded(buf)
        else:
            nbytes = buf.numel() * buf.element_size()
            if buf.untyped_storage().nbytes() != nbytes:
                buf.untyped_storage().resize_(nbytes)
        return self._unsharded_alias  # type: ignore[return-value]

    def unsharded_bytes(self) -> int:
        """Bytes of unsharded parameter storage alive now (0 when resharded)."""
        live = self._unsharded.untyped_storage().nbytes() if self._unsharded is not None else 0
        if self._pending_unshard is not None:
            live += self._pending_unshard.gathered.untyped_storage().nbytes()
        return live

    def _sync_registration(self) -> None:
        """Adopt parameters the user re-registered (``load_state_dict(assign=True)``, setattr).

        A group built on ``meta`` whose every parameter is re-registered with real values (the
        resume path of a model built on meta: ``load_state_dict(..., assign=True)`` or
        ``set_model_state_dict(..., full_state_dict=True)``) first gets a real shard buffer on
        its shard home, as ``to_empty`` would give it, and then takes the values."""
        changed = [(p, t) for p in self.params
                   if (t := p.registered()) is not p.sharded_param and t is not None]
        if (changed and self.shard_buffer.is_meta and len(changed) == len(self.params)
                and not any(t.is_meta for _, t in changed)):
            self.shard_buffer = self.home.zeros(self.shard_buffer.numel(), self.shard_buffer.dtype,
                                                meta=False)
            self._unsharded = self._unsharded_alias = None
        for p, current in changed:
            p.adopt(current, self.shard_buffer)
            p.register(p.sharded_param)
            self._post_forward_shard = None            # stale: the user set new values

    # -- gradients -------------------------------------------------------------------------
    def post_backward(self) -> None:
        """Reduce this group's gradients (or stash them while sync is off), then maybe reshard."""
        self.finish_reduce()
        rd = self.reduce_dtype
        if not self.requires_gradient_sync:
            for p in self.params:
                if p.requires_grad:
                    p.stash_unsharded_grad(rd)
        else:
            grads = [p.take_unsharded_grad(rd) if p.requires_grad else None for p in self.params]
            pg = self.comm.reduce_scatter_pg or self.mesh_info.shard_group
            rs = fsdp_comm.start_reduce_scatter(grads, self.layout, rd, pg, self.divide_factor,
                                                self.pool, self.comm,
                                                always=self.reduce_scatter_unused_params,
                                                device=self.home.device)
            if rs is not None and self.reduce_scatter_unused_params:
                rs.with_grad = [i for i, p in enumerate(self.params) if p.requires_grad]
            self._pending_reduce = rs
        if self.reshard_after_backward:
            self.reshard()

    def has_unsharded_grads(self) -> bool:
        return any(p.has_unsharded_grad() for p in self.params)

    def finish_reduce(self, land: bool = True) -> None:
        """Wait for this group's reduce-scatter (and HSDP all-reduce); add the result into
        ``.grad``.  ``land=False`` (inside backward): a result being copied back to the CPU
        is added later, by :meth:`land` ([Note: FSDP devices] in ``_device.py``)."""
        rs = self._pending_reduce
        if rs is None:
            if land:
                self.land()
            return
        self._pending_reduce = None
        out = fsdp_comm.finish_reduce_scatter(rs, self.pool)
        with_grad = set(rs.with_grad)
        if self.mesh_info.is_hsdp:
            if self._partial_reduce is not None:
                out.add_(self._partial_reduce)
                with_grad |= self._partial_with_grad
                self._partial_reduce, self._partial_with_grad = None, set()
            if not self.requires_all_reduce:
                self._partial_reduce, self._partial_with_grad = out, with_grad
                return
            fsdp_comm.all_reduce_replicas(out, self.mesh_info.replicate_group,  # type: ignore[arg-type]
                                          self.divide_factor, self.comm.force_sum)
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(out)
        if out.dtype != self.orig_dtype:
            out = out.to(self.orig_dtype)
        out, copying = self.home.send_home(out)  # offloaded: the sharded .grad lives on the CPU
        self._landing.append((out, sorted(with_grad), copying))
        if land or copying is None:
            self.land()

    def land(self) -> None:
        """Add the reduced shards into ``.grad`` in the order they were reduced, each once
        its copy to the CPU has finished."""
        while self._landing:
            out, with_grad, copying = self._landing.pop(0)
            if copying is not None:
                copying.synchronize()
            with torch.no_grad():
                for i in with_grad:
                    p = self.params[i]
                    p.accumulate_sharded_grad(p.local_view(out))

    # -- re-materialisation (module._apply: to_empty, to(dtype), ...) ------------------------
    def apply_fn(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a tensor conversion to the shard buffer (and grads), then
        rebuild the parameters."""
        self.finish_reduce()
        self.reshard()
        self._sync_registration()
        grads = [p.sharded_param.grad for p in self.params]
        with torch.no_grad():
            self.shard_buffer = fn(self.shard_buffer)
        # the shards went where fn put them, back to the CPU if offloaded
        self.home = self.home.rebind(self.shard_buffer)
        self.shard_buffer = self.home.place(self.shard_buffer)
        self._unsharded = self._unsharded_alias = None
        for p, g in zip(self.params, grads):
            p.bind_sharded(self.shard_buffer)
            if g is not None:
                local = self.home.place(fn(cast(DTensor, g).to_local()))
                p.sharded_param.grad = p.to_dtensor(local)
            p.register(p.sharded_param)
