"""``ZeroRedundancyOptimizer``: optimizer state sharded across the ranks of a group (ZeRO stage 1).

Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models", SC 2020 (arXiv:1910.02054), the optimizer-state partitioning stage.

Every rank holds all parameters (as with DDP) but runs the wrapped optimizer on
its own shard only, so each rank keeps 1/world of the optimizer state.  After
the local step each rank broadcasts its shard's updated parameters, so all
ranks end the step with identical parameters.  The partition is pure and
deterministic (:func:`partition_parameters`): within each parameter group,
largest parameters first, each goes to the rank with the fewest elements so
far (ties: the lowest rank), counting across groups — torch's assignment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from ringlet.c10d import broadcast, gather_object
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.world import resolve_group
from ringlet.parallel.join import Join, Joinable, JoinHook

__all__ = ["ZeroRedundancyOptimizer", "partition_parameters"]


def partition_parameters(group_numels: list[list[int]], world_size: int) -> list[list[int]]:
    """Pure: the owning rank of every parameter, ``owner[group][i]``.

    Greedy balancing by element count: largest first within a group (stable for
    ties), each to the currently least-loaded rank; loads carry across groups.

    Example::

        partition_parameters([[3, 10, 7, 7, 2, 5]], 2) == [[1, 0, 1, 1, 0, 0]]
    """
    if world_size < 1:
        raise ValueError(f"partition_parameters: expected world_size >= 1, got {world_size}")
    load = [0] * world_size
    owners: list[list[int]] = []
    for numels in group_numels:
        owner = [0] * len(numels)
        for i in sorted(range(len(numels)), key=lambda k: -numels[k]):
            rank = load.index(min(load))
            owner[i] = rank
            load[rank] += numels[i]
        owners.append(owner)
    return owners


class _ZeROJoinHook(JoinHook):
    """A joined rank keeps stepping its shard, so it matches the active ranks' broadcasts."""

    def __init__(self, zero: ZeroRedundancyOptimizer) -> None:
        self._zero = zero

    def main_hook(self) -> None:
        self._zero._step_and_sync(None)


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


class ZeroRedundancyOptimizer(Optimizer, Joinable):
    """Wrap ``optimizer_class`` so that each rank keeps only its shard of the optimizer state.

    Args:
        params: parameters or parameter groups (dicts), identical on every rank.
        optimizer_class: the local optimizer, e.g. ``torch.optim.Adam``.
        process_group: the group to shard over; None for the default group (fixed at construction).
        parameters_as_bucket_view: pack each rank's trainable parameters into one
            contiguous buffer (``param.data`` becomes a view of it), so a step
            broadcasts one tensor per rank instead of one per parameter.
        overlap_with_ddp: not supported by ringlet (raises ``NotImplementedError``).
        **defaults: keyword arguments of ``optimizer_class`` (``lr=...``).

    Raises:
        NotImplementedError: ``overlap_with_ddp=True``.
        ValueError: a non-member group, or (bucket view) parameters of mixed
            dtype or device on one rank.

    Example::

        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
        loss.backward(); opt.step()
        opt.consolidate_state_dict(to=0)
        if rank == 0: torch.save(opt.state_dict(), "opt.pt")
    """

    def __init__(self, params: Iterable[Any], optimizer_class: type[Optimizer],
                 process_group: GroupArg = None, parameters_as_bucket_view: bool = False,
                 overlap_with_ddp: bool = False,
                 **defaults: Any) -> None:
        if overlap_with_ddp:
            raise NotImplementedError("ZeroRedundancyOptimizer: overlap_with_ddp=True "
                                      "(stepping inside DDP's comm hook) is not supported by "
                                      "ringlet; use overlap_with_ddp=False")
        if isinstance(params, torch.Tensor):
            raise TypeError("ZeroRedundancyOptimizer: expected an iterable of "
                            "Tensors or dicts, got a Tensor")
        self._initialized = False
        Optimizer.__init__(self, params, defaults)
        Joinable.__init__(self)
        pg = resolve_group(process_group)
        if pg is None:
            raise ValueError("ZeroRedundancyOptimizer: expected a process_group this rank is a "
                             "member of, got a non-member group")
        self.process_group = process_group
        self._pg: ProcessGroup = pg
        self.world_size = pg.size()
        self.rank = pg.rank()
        self.global_rank = pg.ranks[self.rank]
        self._optimizer_class = optimizer_class
        self._bucket_view = parameters_as_bucket_view
        self._owners = self._partition()
        self.optim: Optimizer = optimizer_class(self._local_groups(self.rank), **defaults)
        self._copy_hyper(self.optim.param_groups, self.param_groups)
        self._buckets: list[torch.Tensor] | None = None
        self._trainable = self._trainable_mask()
        self._build_buckets()
        self._all_state_dicts: list[dict[str, Any]] | None = None
        self._initialized = True

    # -- the partition -------------------------------------------------------------------
    def _partition(self) -> list[list[int]]:
        return partition_parameters([[p.numel() for p in g["params"]] for g in self.param_groups],
                                    self.world_size)

    def _local_groups(self, rank: int) -> list[dict[str, Any]]:
        """Rank ``rank``'s shard as parameter groups (one per global group, possibly empty)."""
        return [{**_hyper(g), "params": self._rank_params(rank, gi)}
                for gi, g in enumerate(self.param_groups)]

    def _rank_params(self, rank: int, group: int) -> list[torch.Tensor]:
        params = self.param_groups[group]["params"]
        return [p for p, r in zip(params, self._owners[group]) if r == rank]

    def _shard(self, rank: int) -> list[torch.Tensor]:
        return [p for gi in range(len(self.param_groups)) for p in self._rank_params(rank, gi)]

    @staticmethod
    def _copy_hyper(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
        for s, d in zip(src, dst):
            d.update(_hyper(s))

    # -- stepping ------------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> Any:
        """Step this rank's shard with the local optimizer, then broadcast every shard.

        Returns what the local optimizer's ``step`` returned (the closure's loss).
        """
        Join.notify_join_context(self)
        return self._step_and_sync(closure, **kwargs)

    def _step_and_sync(self, closure: Callable[[], float] | None, **kwargs: Any) -> Any:
        mask = self._trainable_mask()
        if mask != self._trainable:       # requires_grad flipped: re-pack the buckets
            self._trainable = mask
            self._build_buckets()
        # e.g. an LR scheduler changed lr
        self._copy_hyper(self.param_groups, self.optim.param_groups)
        loss = (self.optim.step(closure, **kwargs) if closure is not None
                else self.optim.step(**kwargs))
        self._sync_params()
        self._copy_hyper(self.optim.param_groups, self.param_groups)
        return loss

    def _trainable_mask(self) -> list[bool]:
        return [p.requires_grad for g in self.param_groups for p in g["params"]]

    def _sync_params(self) -> None:
        """Every rank broadcasts its shard; all broadcasts are queued, then waited for."""
        works = []
        for rank in range(self.world_size):
            tensors = ([self._buckets[rank]] if self._buckets is not None
                       else [p.detach() for p in self._shard(rank)])
            for t in tensors:
                if t.numel() > 0:
                    works.append(broadcast(t, group=self._pg, group_src=rank, async_op=True))
        for w in works:
            if w is not None:
                w.wait()

    def _build_buckets(self) -> None:
        """Pack each rank's trainable parameters into one flat tensor
        (parameters_as_bucket_view)."""
        if not self._bucket_view:
            return
        buckets = []
        for rank in range(self.world_size):
            params = [p for p in self._shard(rank) if p.requires_grad]
            kinds = {(p.dtype, p.device) for p in params}
            if len(kinds) > 1:
                raise ValueError("ZeroRedundancyOptimizer(parameters_as_bucket_view=True): "
                                 "expected one dtype and device per rank's shard, got "
                                 f"{sorted(map(str, kinds))} on rank {rank}")
            dtype, device = next(iter(kinds)) if kinds else (torch.float32, torch.device("cpu"))
            bucket = torch.empty(sum(p.numel() for p in params), dtype=dtype, device=device)
            off = 0
            for p in params:
                view = bucket[off:off + p.numel()].view_as(p)
                view.copy_(p.detach())
                p.data = view
                off += p.numel()
            buckets.append(bucket)
        self._buckets = buckets

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group (e.g. layers unfrozen for fine-tuning); every rank must add it.

        Earlier groups keep their owners (the partition runs group by group), so only
        the new group's parameters are distributed.
        """
        Optimizer.add_param_group(self, param_group)
        if not getattr(self, "_initialized", False):
            return      # Optimizer.__init__ adding the constructor's groups
        self._owners = self._partition()
        local = self._local_groups(self.rank)[-1]
        self.optim.add_param_group(local)
        self._copy_hyper(self.optim.param_groups[-1:], self.param_groups[-1:])
        self._trainable = self._trainable_mask()
        self._build_buckets()

    # -- state dicts ---------------------------------------------------------------------
    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collect every rank's shard of the optimizer state on group rank
        ``to``; call on every rank.

        Afterwards :meth:`state_dict` works on rank ``to`` (only).
        """
        if not 0 <= to < self.world_size:
            raise ValueError("consolidate_state_dict: expected to in [0, "
                             f"{self.world_size - 1}], got {to}")
        self._all_state_dicts = None
        self._copy_hyper(self.param_groups, self.optim.param_groups)
        gathered: list[Any] | None = [None] * self.world_size if self.rank == to else None
        gather_object(self.optim.state_dict(), gathered, group=self._pg, group_dst=to)
        if gathered is not None:
            self._all_state_dicts = gathered

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer's state dict, in the format of an unsharded ``optimizer_class``.

        Raises:
            RuntimeError: :meth:`consolidate_state_dict` was not run with this rank as ``to``.
        """
        if self._all_state_dicts is None:
            raise RuntimeError("ZeroRedundancyOptimizer.state_dict: expected the optimizer state "
                               f"consolidated on this rank (group rank {self.rank}) by "
                               f"consolidate_state_dict(to={self.rank}) on every rank, got none")
        index = self._global_index()
        state: dict[int, Any] = {}
        for rank, local in enumerate(self._all_state_dicts):
            for gi, group in enumerate(local["param_groups"]):
                for local_id, param in zip(group["params"], self._rank_params(rank, gi)):
                    if local_id in local["state"]:
                        state[index[id(param)]] = local["state"][local_id]
        groups = [{**_hyper(g), "params": [index[id(p)] for p in g["params"]]}
                  for g in self.param_groups]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    def _global_index(self) -> dict[int, int]:
        params = [p for g in self.param_groups for p in g["params"]]
        return {id(p): i for i, p in enumerate(params)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a whole-optimizer state dict (from :meth:`state_dict`, or an unsharded optimizer's).

        Each rank keeps only its shard's state. Raises ``ValueError`` when the groups' sizes differ.
        """
        groups = state_dict["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in self.param_groups]:
            raise ValueError("ZeroRedundancyOptimizer.load_state_dict: expected parameter groups "
                             f"of sizes {[len(g['params']) for g in self.param_groups]}, got "
                             f"{[len(g['params']) for g in groups]}")
        local_state: dict[int, Any] = {}
        local_groups = []
        local_id = 0
        for gi, (saved, owners) in enumerate(zip(groups, self._owners)):
            ids = []
            for saved_id, owner in zip(saved["params"], owners):
                if owner == self.rank:
                    if saved_id in state_dict["state"]:
                        local_state[local_id] = state_dict["state"][saved_id]
                    ids.append(local_id)
                    local_id += 1
            local_groups.append({**_hyper(saved), "params": ids})
            self.param_groups[gi].update(_hyper(saved))
        self.optim.load_state_dict({"state": local_state, "param_groups": local_groups})

    # -- Joinable ------------------------------------------------------------------------
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """Hook for :class:`Join`: a joined rank keeps stepping (and broadcasting) its shard."""
        return _ZeROJoinHook(self)

    @property
    def join_device(self) -> torch.device:
        return self.param_groups[0]["params"][0].device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self._pg

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self._optimizer_class.__name__}, rank "
                f"{self.rank}/{self.world_size}, {sum(p.numel() for p in self._shard(self.rank))} "
                f"of {sum(p.numel() for g in self.param_groups for p in g['params'])} elements in "
                "this shard)")
