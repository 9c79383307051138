"""fully_shard's hooks and the per-root iteration context: when each group is unsharded,
resharded and reduced, the checked states, prefetch and the final callback.

[Note: FSDP and autograd]
- forward pre-hook: unshard the group (finishing a prefetched all-gather), prefetch the next
  group, cast inputs, and pass the inputs that require grad through ``_PostBackward``.
- forward hook: reshard (``reshard_after_forward``; an int keeps a post-forward shard, see
  [Note: resharding to a smaller group] in ``_param_group``), cast outputs,
  and register a tensor hook
  on every output that requires grad: the *pre-backward* hook.  A tensor hook runs before
  the output's grad_fn, i.e. before any of the module's backward ops: the group is
  re-gathered (and the previous group in forward order prefetched) just in time.
- ``_PostBackward.backward`` runs once the gradients of the module's inputs exist, i.e. when
  the module's backward is done; the autograd engine runs AccumulateGrad nodes first (they
  have the highest priority), so every parameter gradient of the group has been accumulated
  into the unsharded parameters: the group is reduce-scattered and resharded there.
- A module whose inputs need no grad (the root, taking token ids) never sees that node; the
  *final callback* (queued on the autograd engine by the first backward hook of a backward)
  post-backwards every group that still holds unsharded gradients, in a fixed order, waits for
  every reduction and returns every state to IDLE.

[Note: grouped modules]
``fully_shard([a, b])`` gives several modules one state and one group: hooks on each module,
the group's forward begins at the first of them to run (unshard, prefetch) and ends when all
of them ran (reshard), or, for those that never run, at the end of the root's forward.  A
module of the group called on its own outside the root's forward (a chunked loss head) is a
forward of its own.

The iteration context: what the fully_shard modules under one root share during a step
(orders, prefetch, the final callback).  The root is the first fully_shard module whose
forward runs; its lazy init collects every fully_shard module below it (including itself) into
one :class:`IterationContext`.  The context records the forward and post-forward orders in the
first iteration (frozen at the next root forward), from which implicit prefetch picks the next
group: in forward the next group in forward order, in backward the previous group in
post-forward order.  Every rank runs the same forward, so every rank makes the same prefetch
decisions and issues the same collectives in the same order.
"""

from __future__ import annotations

import copy
import enum
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ringlet._compile import compiler_disable
from ringlet.parallel._device_moves import move_to
from ringlet.parallel.fsdp._collectives import BufferPool
from ringlet.parallel.fsdp._param_group import FSDPParamGroup, ShardedState
from ringlet.parallel.fsdp.policies import MixedPrecisionPolicy

__all__ = ["COPY_SCOPE", "FSDPState", "IterationContext", "TrainingState"]

# A key in deepcopy's memo: ids of the FSDPStates being copied ([Note:
# copying a fully_shard module]).
COPY_SCOPE = "ringlet.fsdp.copy_scope"


class TrainingState(enum.Enum):
    """Where a fully_shard module is in the training step."""

    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


_T = TrainingState
# Allowed moves; anything else is a bug (or misuse) reported with both states and the module.
_TRANSITIONS = {
    _T.IDLE: {_T.FORWARD, _T.PRE_BACKWARD, _T.POST_BACKWARD},
    _T.FORWARD: {_T.IDLE},
    _T.PRE_BACKWARD: {_T.POST_BACKWARD},
    _T.POST_BACKWARD: {_T.PRE_BACKWARD, _T.POST_BACKWARD},   # a module used twice in one forward
}


class _PostBackward(torch.autograd.Function):
    """Identity on a module's inputs whose backward marks the end of the module's backward."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)


class FSDPState:
    """The hooks and training state of one ``fully_shard(module)`` call."""

    def __init__(self, modules: list[nn.Module], group: FSDPParamGroup | None,
                 mp_policy: MixedPrecisionPolicy, reshard_after_forward: bool | int | None,
                 device: torch.device | None = None) -> None:
        self.modules = modules                                # [Note: grouped modules]
        self.device = device or torch.device("cpu")          # the mesh's compute device
        self.module = modules[0]
        self.group = group
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward   # None: True unless this is the root
        self.training_state = TrainingState.IDLE
        self.ctx: IterationContext | None = None              # set by the root's lazy init
        self.is_root = False
        self.forward_prefetch: list[FSDPState] | None = None  # explicit, else implicit order
        self.backward_prefetch: list[FSDPState] | None = None
        self.method_depth = 0                                 # inside a registered forward method
        # grouped modules yet to run this forward
        self._to_run: set[int] = set()
        self._handles = []
        for m in modules:
            self._handles += [m.register_forward_pre_hook(self._pre_forward_hook, prepend=True,
                                                          with_kwargs=True),
                              m.register_forward_hook(self._post_forward_hook, prepend=False)]

    def __repr__(self) -> str:
        return f"FSDPState({self.name}, {self.training_state.value}, root={self.is_root})"

    @property
    def name(self) -> str:
        return "+".join(type(m).__name__ for m in self.modules)

    def __deepcopy__(self, memo: dict[int, Any]) -> FSDPState:
        """A copy that is not initialised as anyone's root ([Note: copying a fully_shard module]).

        Prefetch targets outside the copied modules are dropped: the copy must not drag in
        (or reach back into) modules that were not copied.
        """
        new = FSDPState.__new__(FSDPState)
        memo[id(self)] = new
        inside = memo.get(COPY_SCOPE, set())    # type: ignore[call-overload]
        for k, v in self.__dict__.items():
            if k == "ctx":
                new.ctx = None
            elif k in ("forward_prefetch", "backward_prefetch") and v is not None:
                new.__dict__[k] = [copy.deepcopy(s, memo) for s in v if id(s) in inside]
            else:
                new.__dict__[k] = copy.deepcopy(v, memo)
        new.is_root = False
        return new

    def context(self) -> IterationContext:
        if self.ctx is None:
            raise AssertionError(f"fully_shard({self.name}): expected the root's lazy init "
                                 "to have run, got no context")
        return self.ctx

    def transition(self, new: TrainingState, what: str) -> None:
        """Move to ``new``; raises AssertionError naming the module and both
        states if not allowed."""
        cur = self.training_state
        if new not in _TRANSITIONS[cur]:
            allowed = sorted(s.value for s, nxt in _TRANSITIONS.items() if new in nxt)
            raise AssertionError(f"fully_shard({self.name}): {what}: expected training state in "
                                 f"{allowed}, got {cur.value} (if an earlier forward or backward "
                                 "raised, call reset_iter_state() on the root module)")
        self.training_state = new

    # -- forward ---------------------------------------------------------------------------
    # Under torch.compile the hooks run eagerly (a graph break each) and only the module's own
    # forward is traced: what they do (collectives, swapping parameters) must not be traced.
    @compiler_disable
    def _pre_forward_hook(self, module: nn.Module, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        # forward() called by e.g. generate()
        if self.method_depth and self.training_state is _T.FORWARD:
            return args, kwargs
        if len(self.modules) > 1 and self.training_state is _T.FORWARD:
            return self._join_group_forward(args, kwargs)            # [Note: grouped modules]
        out = self.pre_forward(args, kwargs)
        if len(self.modules) > 1 and self.training_state is _T.FORWARD:
            root = self.context().root
            inside = root is not self and root.training_state is _T.FORWARD
            self._to_run = {id(m) for m in self.modules} if inside else {id(module)}
        return out

    @compiler_disable
    def _post_forward_hook(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.method_depth and self.training_state is _T.FORWARD:
            return output
        if len(self.modules) > 1 and self.training_state is _T.FORWARD:
            self._to_run.discard(id(module))
            if self._to_run:                      # other modules of the group still to run
                return self._finish_output(output)
        return self.post_forward(output)

    def _join_group_forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """A further module of a grouped fully_shard runs in the group's forward."""
        self._unshard_now()
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.mp_policy.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._wrap_inputs(args, kwargs)
        return args, kwargs

    def complete_forward(self) -> None:
        """The root's forward ended before every module of this group ran:
        end the group's forward."""
        if self.training_state is _T.FORWARD:
            self._to_run.clear()
            self._end_forward()

    def pre_forward(self, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.ctx is None:
            IterationContext.lazy_init(self)
        ctx = self.context()
        if self.training_state in (_T.PRE_BACKWARD, _T.POST_BACKWARD):   # recomputation in backward
            self._unshard_now()
            return args, kwargs
        if self.is_root:
            ctx.root_pre_forward()
            args, kwargs = self._inputs_to_device(args, kwargs)
        self.transition(_T.FORWARD, "pre-forward")
        if self.group is not None:
            self.group._post_forward_shard = None   # kept only from this forward's unshard
        self._unshard_now()
        ctx.record_forward(self)
        ctx.prefetch(self, self.forward_prefetch, forward=True)
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast((args, kwargs), self.mp_policy.param_dtype)
        if torch.is_grad_enabled():
            args, kwargs = self._wrap_inputs(args, kwargs)
        return args, kwargs

    def post_forward(self, output: Any) -> Any:
        if self.training_state in (_T.PRE_BACKWARD, _T.POST_BACKWARD):
            return output
        self._end_forward()
        return self._finish_output(output)

    def _end_forward(self) -> None:
        if self.is_root:
            for s in self.context().states:
                if s is not self:
                    s.complete_forward()
        if self.group is not None and self._reshard_after_forward():
            self.group.reshard(post_forward=isinstance(self.reshard_after_forward, int)
                               and not isinstance(self.reshard_after_forward, bool))
        self.context().record_post_forward(self)
        self.transition(_T.IDLE, "post-forward")

    def _finish_output(self, output: Any) -> Any:
        if self.mp_policy.output_dtype is not None:
            output = _cast(output, self.mp_policy.output_dtype)
        if torch.is_grad_enabled():
            for t in pytree.tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward_hook)
        return output

    def _inputs_to_device(self, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The root moves its tensor inputs to its compute device, as torch's FSDP2 does (a GPU:
        [Note: FSDP devices] in ``_device.py``); on the CPU nothing is touched."""
        device = self.group.home.device if self.group is not None else self.device
        if device.type == "cpu":
            return args, kwargs
        return move_to(args, device), move_to(kwargs, device)

    def _reshard_after_forward(self) -> bool:
        r = self.reshard_after_forward
        return (not self.is_root) if r is None else bool(r)

    def _wrap_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        idx = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not idx:
            return args, kwargs
        wrapped = _PostBackward.apply(self, *[leaves[i] for i in idx])
        for i, t in zip(idx, wrapped):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, spec)

    def _unshard_now(self) -> None:
        if self.group is not None:
            self.group.unshard()

    # -- backward --------------------------------------------------------------------------
    def _pre_backward_hook(self, grad: torch.Tensor) -> None:
        self.pre_backward()

    def pre_backward(self) -> None:
        ctx = self.context()
        ctx.ensure_final_callback()
        if self.training_state is _T.PRE_BACKWARD:
            return
        self.transition(_T.PRE_BACKWARD, "pre-backward")
        if self.group is not None and self.group.unshard_in_backward:
            self.group.unshard()
        ctx.prefetch(self, self.backward_prefetch, forward=False)

    def post_backward(self) -> None:
        ctx = self.context()
        ctx.ensure_final_callback()
        if self.training_state is _T.POST_BACKWARD and not self._has_work():
            return
        if self.training_state is not _T.POST_BACKWARD:
            self.transition(_T.POST_BACKWARD, "post-backward")
        if self.group is not None:
            ctx.finish_reductions(land=False)
            self.group.post_backward()
            ctx.note_reduction(self.group)

    def _has_work(self) -> bool:
        g = self.group
        return g is not None and (g.has_unsharded_grads()
                                  or g.sharded_state is ShardedState.UNSHARDED)

    def needs_post_backward(self) -> bool:
        """Checked by the final callback: did this backward leave work here?"""
        if self.training_state is _T.PRE_BACKWARD:
            return True
        g = self.group   # grads left from no-sync micro-batches are reduced once sync is back on
        return self.training_state is _T.IDLE and g is not None and g.requires_gradient_sync and \
            g.has_unsharded_grads()

    def to_idle(self) -> None:
        """End of backward (or a reset): every state is IDLE again."""
        self.training_state = _T.IDLE

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    def cast(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != dtype:
            return t.to(dtype)
        return t
    return pytree.tree_map(cast, tree)


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
        self._landing: list[FSDPParamGroup] = []   # groups with results on their way to the CPU
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

    def finish_reductions(self, land: bool = True) -> None:
        """Wait for every reduction in flight and add the results into the sharded gradients;
        ``land=False`` (inside backward) leaves results still being copied to the CPU for a
        later call ([Note: FSDP devices] in ``_device.py``)."""
        while self._reducing:
            group = self._reducing.pop(0)
            group.finish_reduce(land)
            if group._landing and group not in self._landing:
                self._landing.append(group)
        if land:
            while self._landing:
                self._landing.pop(0).land()

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
                g._landing.clear()
                g.reshard()
            s.to_idle()
        self._reducing.clear()
        self._landing.clear()


def _after(order: list[FSDPState], state: FSDPState) -> list[FSDPState]:
    try:
        i = order.index(state)
    except ValueError:
        return []
    return order[i + 1:i + 2]
