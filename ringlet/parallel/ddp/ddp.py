"""``DistributedDataParallel``: torch's constructor and behaviour over ringlet's process groups.

The module keeps its group (``process_group``, ``device_mesh.get_group()`` or the default
group at construction) and never looks the world up again.  Construction verifies that every
rank holds the same parameters and buffers, then broadcasts rank 0's values.  Each training
forward may broadcast buffers, rebuild buckets once, and tell the reducer to expect a
backward; the reducer (``_reducer.py``) does the gradient all-reduce during backward.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ringlet._compile import compiler_disable
from ringlet.parallel._device_moves import move_to
from ringlet.parallel.ddp import _checks, _options, _tp
from ringlet.parallel.ddp._join import DDPJoinHook, Join, Joinable, active_iteration
from ringlet.parallel.ddp._logging import DDPLogging
from ringlet.parallel.ddp._reducer import Phase, Reducer, traced

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg, ProcessGroup
    from ringlet.mesh import DeviceMesh

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.Module, Joinable):
    """Data parallelism: replicate ``module`` on every rank, average gradients in backward.

    Args:
        module: the model, its parameters on one device (the CPU, or one GPU: docs/gpu.md).
        device_ids: ``None``, or for a CUDA module ``[i]``, its device: ``forward`` then moves
            its tensor arguments to ``cuda:i``.  A CPU module takes ``None``.
        output_device: for a CUDA module, the device index of the outputs (default
            ``device_ids[0]``; outputs stay where the module puts them, as in torch).
        dim: accepted for torch's signature (the batch dim of DataParallel's scatter).
        broadcast_buffers: deprecated (torch 2.13): ``forward_sync_buffers``, except that ``False``
            also leaves buffers out of the construction-time sync (``FutureWarning``).
        init_sync: broadcast rank 0's parameters and buffers at construction.
        process_group: the group to reduce over (default: the default group).
        bucket_cap_mb: bucket size in MiB (default 25; the first bucket is 1 MiB), or a list of
            sizes, one per bucket (same as ``bucket_cap_mb_list``).
        find_unused_parameters: find parameters the forward did not use (walks the autograd
            graph each iteration) so their buckets need not wait; parameters used on some ranks
            only get the average of the ranks' gradients (zeros from the others).
        check_reduction: ignored (deprecated in torch).
        gradient_as_bucket_view: ``.grad`` tensors are views of the bucket buffers (no copies).
        static_graph: the graph is the same every iteration; allows a parameter to be reused in
            several reentrant checkpoints.
        delay_all_reduce_named_params, param_to_hook_all_reduce, mixed_precision: not supported
            (``NotImplementedError`` when given).
        device_mesh: a 1-d mesh whose group to use (instead of ``process_group``), typically
            ``mesh["dp"]`` of a 2-d mesh whose other axis holds tensor-parallel DTensor
            parameters: those are handed to DDP as local tensors (``_tp.py``).
        skip_all_reduce_unused_params: with ``find_unused_parameters``, skip buckets whose
            parameters are all unused (they must then be unused on every rank).
        bucket_cap_mb_list: per-bucket sizes in MiB: bucket ``k`` holds up to ``list[k]`` (the
            last size repeats); no small first bucket.
        batched_grad_copy: accepted; ringlet copies each gradient into its bucket as it arrives
            (on the CPU there are no kernel launches to batch).
        forward_sync_buffers: broadcast rank 0's buffers before each synchronised training
            forward (default True); buffers are synced at construction either way.

    Raises:
        RuntimeError: the ranks' models differ (names the rank and the first difference), or
            no parameter requires a gradient.
        ValueError: conflicting or unsupported arguments.

    Example::

        model = DistributedDataParallel(nn.Linear(8, 4))
        loss = model(torch.randn(16, 8)).sum()
        loss.backward()            # .grad now holds the average over ranks
        with model.no_sync():      # gradient accumulation: no communication
            model(x).sum().backward()
    """

    reducer: Reducer        # hooks and buckets (a plain attribute: not a submodule)
    module: nn.Module

    def __init__(self, module: nn.Module, device_ids: list[Any] | None = None,
                 output_device: Any = None,
                 dim: int = 0, broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: GroupArg = None, bucket_cap_mb: float | list[float] | None = None,
                 find_unused_parameters: bool = False, check_reduction: bool = False,
                 gradient_as_bucket_view: bool = False, static_graph: bool = False,
                 delay_all_reduce_named_params: Any = None, param_to_hook_all_reduce: Any = None,
                 mixed_precision: Any = None, device_mesh: DeviceMesh | None = None,
                 skip_all_reduce_unused_params: bool = False,
                 bucket_cap_mb_list: list[float] | None = None,
                 batched_grad_copy: bool = False, forward_sync_buffers: bool | None = None) -> None:
        nn.Module.__init__(self)
        Joinable.__init__(self)
        _options.refuse_unsupported(delay_all_reduce_named_params, param_to_hook_all_reduce,
                                    mixed_precision)
        self.bucket_bytes_cap, self.bucket_bytes_cap_list = _options.bucket_caps(bucket_cap_mb,
                                                                                 bucket_cap_mb_list)
        self.forward_sync_buffers, init_sync_buffers = _options.buffer_sync(broadcast_buffers,
                                                                            forward_sync_buffers)
        self.module = module
        self.process_group = _options.pick_group(process_group, device_mesh)
        self.device_mesh = device_mesh
        if _tp.has_dtensor_params(module):      # tensor parallel inside: DDP sees local tensors
            _tp.check_dp_orthogonal(module, self.process_group)
            _tp._pre_dp_module_transform(module)
        ignore = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        named_params = [(n, p) for n, p in module.named_parameters() if n not in ignore]
        named_buffers = [(n, b) for n, b in module.named_buffers() if n not in ignore]
        _options.refuse_dtensor_buffers(named_buffers)
        plan = _options.check_devices(named_params, device_ids, output_device)
        trained = [(n, p) for n, p in named_params if p.requires_grad]
        if not trained:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have "
                               "any parameter that requires a gradient.")
        self.device_ids = plan.device_ids          # [i] for a GPU module that named its device
        self.output_device = plan.output_device
        self.device = plan.device
        self.device_type = plan.device.type if plan.device is not None else "cpu"
        self.dim = dim
        self.batched_grad_copy = bool(batched_grad_copy)
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.check_reduction = check_reduction
        self.skip_all_reduce_unused_params = skip_all_reduce_unused_params
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self._divide_by_initial_world_size = True
        self._ignore = ignore
        self._all_params = [p for _, p in named_params]
        # Where the buffers live (module, name): found once, as torch's DDP does; the tensors
        # are read afresh each time (module.to() / _apply() replace them).
        slots = [(f"{prefix}.{name}" if prefix else name, mod, name)
                 for prefix, mod in module.named_modules() for name in mod._buffers]
        self._buffer_slots = [s for s in slots if s[0] not in ignore]

        pg = self.process_group
        with traced("DistributedDataParallel.__init__"):
            _checks.verify_same_model(_checks.describe(named_params, named_buffers), pg)
            if init_sync:
                buffers = [b for _, b in named_buffers] if init_sync_buffers else []
                _checks.broadcast_coalesced(self._all_params + buffers, pg, 0)
        self._logging = DDPLogging(self)
        self._build_reducer()
        self._logging.config()

    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name of ``forward_sync_buffers``."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = bool(value)

    def _build_reducer(self) -> None:
        trained = [(n, p) for n, p in self.module.named_parameters()
                   if n not in self._ignore and p.requires_grad]
        self.reducer = Reducer(
            [p for _, p in trained], [n for n, _ in trained], self.process_group,
            cap_bytes=self.bucket_bytes_cap,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            skip_all_reduce_unused_params=self.skip_all_reduce_unused_params,
            caps=self.bucket_bytes_cap_list or None, device=self.device)
        self.reducer.on_finalized = self._logging.reduction_done
        self.reducer.on_error = self._logging.log_error

    # -- forward -------------------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # Under torch.compile only the module's own forward is traced: DDP's steps before and
        # after it (collectives, bookkeeping) run eagerly, a graph break each.
        with traced("DistributedDataParallel.forward"):
            training = torch.is_grad_enabled()
            inputs, kwargs, join_work = self._before_module(training, inputs, kwargs)
            out = self.module(*inputs, **kwargs)
            return self._after_module(training, out, join_work)

    @compiler_disable
    def _before_module(self, training: bool, inputs: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        join_work = None
        if training:
            join_work = self._pre_forward(training and self.require_backward_grad_sync)
            self._logging.forward_start()
        if self.device_ids:            # torch moves the inputs to device_ids[0]
            if self.device is None:
                raise AssertionError("DDP: device_ids given but no device planned")
            inputs, kwargs = move_to((inputs, kwargs), self.device)
        return inputs, kwargs, join_work

    @compiler_disable
    def _after_module(self, training: bool, out: Any, join_work: Any) -> Any:
        if training:
            self._logging.forward_end()
        if training and self.require_backward_grad_sync:
            self.reducer.prepare_for_backward(out, join_work, self._divide_by_initial_world_size)
        elif training:
            self.reducer.skip_backward()
        return out

    def _pre_forward(self, sync: bool) -> Any:
        """Collectives before a training forward: Join's flag, bucket rebuild, buffer broadcast."""
        reducer = self.reducer
        reducer.check_finished()
        join_work, sync, src, rebuild = active_iteration(self, sync)
        if rebuild:
            reducer.rebuild_buckets(src)
        self.require_forward_param_sync = sync
        if sync and self.broadcast_buffers:
            self.sync_buffers(src, "buffer broadcast before forward")
        return join_work

    def _named_buffers(self) -> list[tuple[str, torch.Tensor]]:
        """The module's buffers (each tensor once, as ``named_buffers``), read afresh."""
        return _checks.live_buffers(self._buffer_slots)

    def sync_buffers(self, src: int, what: str = "buffer broadcast") -> None:
        """Broadcast the module's buffers from group rank ``src`` (every rank of the group calls
        it; ``what`` names the step in errors).  DDP calls it before a synchronised forward, and
        Join's hook on a rank that ran out of data, so that the ranks' collectives match.

        A second forward before backward (the GAN pattern: D(real), D(fake), one backward) must
        not overwrite buffers that the first forward's graph saved (BatchNorm saves its running
        statistics): then receiving ranks get new buffer tensors instead.
        """
        old = [b for _, b in self._named_buffers()]
        if not old:
            return
        replace = self.reducer.phase is Phase.PREPARED
        with self.reducer.annotate(what):
            new = _checks.broadcast_coalesced(old, self.process_group, src, replace=replace)
        _checks.swap_buffers(self.module, old, new)

    def sync_parameters_and_buffers(self, src: int, what: str = "model broadcast") -> None:
        """Broadcast every parameter and buffer from group rank ``src`` (every rank of the group
        calls it; ``what`` names the step in errors).  Join's hook calls it when all ranks have
        joined, so that they end with the last joiner's model."""
        buffers = [b for _, b in self._named_buffers()]
        with self.reducer.annotate(what):
            _checks.broadcast_coalesced(self._all_params + buffers, self.process_group, src)

    # -- gradient accumulation -----------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip the gradient all-reduce for backward passes of forwards run inside this context.

        Gradients accumulate locally; the first synchronised backward after it averages the sum.

        Example::

            with ddp.no_sync():
                for x in micro_batches[:-1]:
                    ddp(x).sum().backward()
            ddp(micro_batches[-1]).sum().backward()   # all-reduces the accumulated gradients
        """
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # -- communication hooks -------------------------------------------------------------------
    def register_comm_hook(self, state: object, hook: Callable[..., torch.futures.Future]) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` instead of an
        all-reduce.

        The hook gets a :class:`~ringlet.parallel.ddp.GradBucket` whose buffer holds this rank's
        (not yet averaged) gradients; the future's tensor is written into the bucket.  Register
        once, before the first backward.

        Raises:
            RuntimeError: a hook is already registered, or a backward is in progress.
            TypeError: ``hook`` is not callable.
        """
        if not callable(hook):
            self._raise(TypeError, "register_comm_hook: communication hook must be callable "
                                   "(expected hook(state, bucket) -> Future), got "
                                   f"{type(hook).__name__}")
        if self.reducer.comm_hook is not None:
            self._raise(RuntimeError, "register_comm_hook: expected a single registration, but a "
                                      "communication hook is already registered "
                                      "(register_comm_hook can only be called once)")
        if self.reducer.phase is Phase.REDUCING:
            self._raise(RuntimeError,
                        "register_comm_hook: expected no backward in progress, got one")
        self.reducer.comm_hook = (state, hook)

    def _register_builtin_comm_hook(self, comm_hook_type: Any) -> None:
        """torch's C++ built-in hooks by enum: ``ALLREDUCE`` or ``FP16_COMPRESS``
        (``dist.BuiltinCommHookType``)."""
        from ringlet.parallel.comm_hooks import default_hooks

        name = getattr(comm_hook_type, "name", str(comm_hook_type))
        hooks = {"ALLREDUCE": default_hooks.allreduce_hook,
                 "FP16_COMPRESS": default_hooks.fp16_compress_hook}
        if name not in hooks:
            self._raise(ValueError,
                        "_register_builtin_comm_hook: expected ALLREDUCE or FP16_COMPRESS, got "
                        f"{name}")
        self.register_comm_hook(self.process_group, hooks[name])

    def _set_static_graph(self) -> None:
        """torch's older way to ask for ``static_graph=True`` (before the first iteration)."""
        if self.static_graph:
            warnings.warn("You've set static_graph to be True, no need to set it again.",
                          stacklevel=2)
            return
        if self.reducer.reductions or self._logging.forwards:
            self._raise(RuntimeError, "DDP._set_static_graph() should be called before training "
                                      "loop starts and after DistributedDataParallel is "
                                      "constructed (expected no iteration yet, got "
                                      f"{self._logging.forwards} forwards on rank "
                                      f"{self.process_group.rank()})")
        self.static_graph = True
        self.reducer.enable_static_graph()
        self._logging.data["static_graph"] = 1

    def _raise(self, kind: type[Exception], message: str) -> None:
        """Raise ``kind(message)`` and keep it in the logging data (torch's ``_log_and_throw``)."""
        self._logging.log_error(message)
        raise kind(message)

    # -- logging data and checks ---------------------------------------------------------------
    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """Configuration, bucket layout, sampled timings (ns) and the last error (see
        ``_logging.py``)."""
        return dict(self._logging.data)

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Time every ``sample_rate``-th iteration after the first 10 (which are always timed)."""
        self._logging.set_sample_rate(sample_rate)

    def _check_reducer_finalized(self) -> None:
        """Raise if the last synchronised backward started but did not finish its reduction."""
        self.reducer.check_finished(reset=False)

    # -- pickling ------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        """The module and settings; the group and the reducer are rebuilt on unpickling (as in
        torch).

        Raises:
            RuntimeError: DDP runs on a group other than the default one.
        """
        from ringlet.c10d.world import resolve_group

        if self.process_group is not resolve_group(None):
            self._raise(RuntimeError, "DDP Pickling/Unpickling are only supported when using DDP "
                                      "with the default process group (expected the default group, "
                                      "got one passed as process_group or device_mesh)")
        state = dict(self.__dict__)
        for key in ("process_group", "reducer", "_logging", "device_mesh"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Attach to the current default group and rebuild the reducer (no construction-time
        sync)."""
        from ringlet.c10d.world import resolve_group

        self.__dict__.update(state)
        self.process_group = resolve_group(None)
        self.device_mesh = None
        self._logging = DDPLogging(self)
        self._build_reducer()
        self._logging.config()

    # -- Join (uneven inputs) ------------------------------------------------------------------
    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Any:
        """A :class:`Join` context for this model alone: ranks may run different numbers of batches.

        A rank that runs out of data shadows the others' collectives with zeros until all are
        done; then the last rank to finish broadcasts the final parameters.  With
        ``divide_by_initial_world_size=False`` gradients are averaged over the ranks still active.

        Example::

            with ddp.join():
                for x in loader:            # lengths may differ between ranks
                    ddp(x).sum().backward()
                    opt.step(); opt.zero_grad()
        """
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size)

    def join_hook(self, **kwargs: Any) -> DDPJoinHook:
        """The hook a :class:`Join` context runs for this model on a rank that ran out of data.

        ``divide_by_initial_world_size`` (default True) applies to this model's iterations from
        now on, on active ranks and in the hook alike."""
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        self._divide_by_initial_world_size = divide
        return DDPJoinHook(self, divide)

    @property
    def join_device(self) -> torch.device:
        return self._all_params[0].device

    @property
    def join_process_group(self) -> ProcessGroup:
        return self.process_group

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(module: nn.Module,
                                                    params_and_buffers_to_ignore: Any
                                                    ) -> None:
        """Exclude these fully-qualified names from DDP's broadcast and reduction (torch's API)."""
        module._ddp_params_and_buffers_to_ignore = list(params_and_buffers_to_ignore)  # type: ignore[assignment]

