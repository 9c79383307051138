"""What the fully_shard modules under one root share during a step: orders,
prefetch, the final callback.

The root is the first fully_shard module whose forward runs; its lazy init collects every
fully_shard module below it (including itself) into one :class:`IterationContext`.  The
context records the forward and post-forward orders in the first iteration (frozen at the
next root forward), from which implicit prefetch picks the next group: in forward the next
group in forward order, in backward the previous group in post-forward order.  Every rank
runs the same forward, so every rank makes the same prefetch decisions and issues the same
collectives in the same order.
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.parallel.fsdp._collectives import BufferPool
from ringlet.parallel.fsdp._param_group import FSDPParamGroup, ShardedState
from ringlet.parallel.fsdp._state import FSDPState, TrainingState

__all__ = ["IterationContext"]


class IterationContext:
    """Per-root bookkeeping shared by the root's fully_shard states."""

    def __init__(self, root: FSDPState, states: list[FSDPState]) -> None:
        self.root = root
        self.states = states                       # module order under the root, root first
        self.forward_order: list[FSDPState] = []
        self.post_forward_order: list[FSDPState] = []
        self.order_frozen = False
        self.post_optim_event: Any = None
        self._reducing: list[FSDPParamGroup] = []  # groups with a reduction in flight
        self._callback_queued = False

    @staticmethod
    def lazy_init(state: FSDPState) -> None:
        """Make ``state`` the root of every fully_shard module under it (first forward only)."""
        found = [s for m in state.module.modules()
                 if isinstance(s := m.__dict__.get("_fsdp_state"), FSDPState)]
        states = list({id(s): s for s in found}.values())      # grouped modules share one state
        ctx = IterationContext(state, states)
        pool = getattr(state, "shared_pool", None) or BufferPool()   # share_comm_ctx
        for s in states:
            s.ctx = ctx
            s.is_root = s is state
            if s.group is not None:
                s.group.pool = pool     # [Note: buffer reuse]: blocks of equal size share buffers

    def __repr__(self) -> str:
        return (f"IterationContext(root {self.root.name}, {len(self.states)} modules, "
                f"frozen={self.order_frozen})")

    # -- forward -----------------------------------------------------------------------------
    def root_pre_forward(self) -> None:
        if self.forward_order and not self.order_frozen:
            self.order_frozen = True
        self.post_optim_event = None   # CPU: the optimizer step has finished when forward starts
        self.finish_reductions()       # a backward whose final callback did not run (e.g. an error)

    def record_forward(self, state: FSDPState) -> None:
        if not self.order_frozen and state not in self.forward_order:
            self.forward_order.append(state)

    def record_post_forward(self, state: FSDPState) -> None:
        if not self.order_frozen and state not in self.post_forward_order:
            self.post_forward_order.append(state)

    def prefetch(self, state: FSDPState, explicit: list[FSDPState] | None, forward: bool) -> None:
        """Start the all-gathers of the groups that run after ``state`` (explicit
        list or implicit order)."""
        if explicit is not None:
            targets = explicit
        elif forward:
            targets = _after(self.forward_order, state) if self.order_frozen else []
        else:
            targets = _after(self.post_forward_order[::-1], state)
        for t in targets:
            g = t.group
            if g is None or g.sharded_state is ShardedState.UNSHARDED:
                continue
            if not forward and (not g.unshard_in_backward
                                or t.training_state is not TrainingState.IDLE):
                continue
            g.unshard(async_op=True)

    # -- backward ----------------------------------------------------------------------------
    def ensure_final_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._final_callback)

    def note_reduction(self, group: FSDPParamGroup) -> None:
        if group._pending_reduce is not None:
            self._reducing.append(group)

    def finish_reductions(self) -> None:
        """Wait for every reduction in flight and add the results into the sharded gradients."""
        while self._reducing:
            self._reducing.pop(0).finish_reduce()

    def _final_callback(self) -> None:
        # _callback_queued stays True until the end: post_backward below must not queue another.
        try:
            # a fixed order: every rank issues the same collectives
            for s in reversed(self.states):
                if s.needs_post_backward():
                    s.post_backward()
            self.finish_reductions()
            for s in self.states:
                if s.group is not None and s.group.reshard_after_backward:
                    s.group.reshard()
                s.to_idle()
        finally:
            self._callback_queued = False

    def reset(self) -> None:
        """Drop this iteration's state after an error (``FSDPModule.reset_iter_state``)."""
        self._callback_queued = False
        for s in self.states:
            g = s.group
            if g is not None:
                g._pending_reduce = None
                g.reshard()
            s.to_idle()
        self._reducing.clear()


def _after(order: list[FSDPState], state: FSDPState) -> list[FSDPState]:
    try:
        i = order.index(state)
    except ValueError:
        return []
    return order[i + 1:i + 2]
