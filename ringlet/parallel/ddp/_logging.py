"""DDP's logging data (``ddp._get_ddp_logging_data()``): configuration, bucket layout, timings,
errors.

torch's DDP keeps a C++ ``Logger`` whose fields scripts and tests read by name; ringlet keeps the
same names where they mean the same thing here:

- configuration: ``world_size``, ``rank``, ``module_name``, ``backend_name``, ``device_ids``
  (``""`` for a CPU module), ``output_device`` (-1 for a CPU module), ``broadcast_buffers``,
  ``bucket_cap_bytes``, ``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``,
  ``dtypes``, ``total_parameter_size_bytes``, ``num_parameter_tensors``, ``bucket_sizes`` (bytes per
  bucket at construction), the environment (``master_addr``, ``master_port``,
  ``torch_distributed_debug``, ...);
- after the bucket rebuild: ``has_rebuilt_buckets``, ``rebuilt_bucket_sizes``,
  ``rebuilt_per_bucket_param_indices``, ``prev_iteration_grad_ready_order_indices``;
- timings of sampled iterations, in nanoseconds (host clock, ``time.perf_counter_ns``):
  ``forward_compute_time``, ``backward_compute_time`` (backward start to the end of autograd),
  ``backward_comm_time`` (first bucket launch to the last reduction copied out),
  ``backward_compute_comm_overlap_time``, their ``avg_*`` over sampled iterations, and the
  ``*_start``/``*_end`` stamps; ``iteration`` is the index (from 0) of the last sampled one.
  The first 10 iterations are sampled, then every ``sample_rate``-th
  (``_set_ddp_runtime_logging_sample_rate``, default 100), as in torch;
- ``unused_parameter_size`` (bytes without a gradient in the last iteration),
  ``can_set_static_graph`` (every iteration so far used the same parameters);
- ``has_error`` / ``error``: the last error DDP raised.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["DDPLogging"]

_ENV = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT",
        "torch_distributed_debug": "TORCH_DISTRIBUTED_DEBUG",
        "cuda_visible_devices": "CUDA_VISIBLE_DEVICES", "gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
        "gloo_device_transport": "GLOO_DEVICE_TRANSPORT"}
_TIMINGS = ("forward_compute_time", "backward_compute_time", "backward_comm_time",
            "backward_compute_comm_overlap_time")
_ALWAYS_SAMPLED = 10


class DDPLogging:
    """The logging data of one DDP module (see the module docstring)."""

    def __init__(self, ddp: Any) -> None:
        self.ddp = ddp
        self.sample_rate = 100
        self.forwards = 0                   # training forwards seen (the next one's index)
        self._sampled: int | None = None    # index of the forward being timed
        self._forward_ns: tuple[int, int] = (0, 0)
        self._totals = dict.fromkeys(_TIMINGS, 0)
        self._samples = 0
        self.data: dict[str, Any] = {}
        self._used_sets: set[tuple[bool, ...]] = set()

    def config(self) -> None:
        """Record the construction-time fields."""
        ddp, reducer = self.ddp, self.ddp.reducer
        params = reducer.params
        d = self.data
        d.update(world_size=ddp.process_group.size(), rank=ddp.process_group.rank(),
                 module_name=type(ddp.module).__name__,
                 device_ids=" ".join(map(str, ddp.device_ids or [])),
                 output_device=-1 if ddp.output_device is None else ddp.output_device,
                 broadcast_buffers=int(ddp.broadcast_buffers),
                 bucket_cap_bytes=ddp.bucket_bytes_cap,
                 find_unused_parameters=int(ddp.find_unused_parameters),
                 gradient_as_bucket_view=int(ddp.gradient_as_bucket_view),
                 static_graph=int(ddp.static_graph),
                 is_multi_device_module=0, backend_name=_backend(ddp.process_group),
                 dtypes=", ".join(sorted({_dtype_name(p.dtype) for p in params})),
                 total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in params),
                 num_parameter_tensors=len(params), bucket_sizes=_sizes(reducer),
                 has_rebuilt_buckets=0, iteration=0, has_error=0)
        for key, var in _ENV.items():
            d[key] = os.environ.get(var, "N/A")
        if d["backend_name"] == "gloo":
            # ringlet runs one communication thread per group (torch's gloo: 2)
            d["gloo_num_threads"] = 1

    def set_sample_rate(self, rate: int) -> None:
        if not isinstance(rate, int) or isinstance(rate, bool) or rate < 1:
            raise ValueError("_set_ddp_runtime_logging_sample_rate: expected an int >= 1, got "
                             f"{rate!r}")
        self.sample_rate = rate

    def log_error(self, message: str) -> None:
        self.data["has_error"] = 1
        self.data["error"] = message

    # -- per iteration ---------------------------------------------------------------------
    def forward_start(self) -> None:
        i = self.forwards
        self.forwards += 1
        sampled = i < _ALWAYS_SAMPLED or i % self.sample_rate == 0
        self._sampled = i if sampled else None
        self._forward_ns = (time.perf_counter_ns(), 0)

    def forward_end(self) -> None:
        self._forward_ns = (self._forward_ns[0], time.perf_counter_ns())

    def reduction_done(self, reducer: Any) -> None:
        """Called by the reducer after a synchronised backward (see ``Reducer.on_finalized``)."""
        self._used_sets.add(tuple(reducer.used_last))
        d = self.data
        d["unused_parameter_size"] = sum(p.numel() * p.element_size()
                                         for p, used in zip(reducer.params, reducer.used_last)
                                         if not used)
        d["can_set_static_graph"] = int(len(self._used_sets) == 1)
        if reducer.rebuilt and not d["has_rebuilt_buckets"]:
            d.update(has_rebuilt_buckets=1, rebuilt_bucket_sizes=_sizes(reducer),
                     rebuilt_per_bucket_param_indices=", ".join(
                         " ".join(str(i) for i in b.plan.indices) for b in reducer.layout.buckets),
                     prev_iteration_grad_ready_order_indices=", ".join(
                         str(i) for i in reducer.observed))
        if self._sampled is not None:
            self._record_times(reducer.times)

    def _record_times(self, t: dict[str, int]) -> None:
        fwd0, fwd1 = self._forward_ns
        b0, b1, c1 = t["backward_start"], t["finalize_start"], t["finalize_end"]
        c0 = min(max(t.get("first_launch", b1), b0), c1)
        times = {"forward_compute_time": max(1, fwd1 - fwd0),
                 "backward_compute_time": max(1, b1 - b0),
                 "backward_comm_time": max(1, c1 - c0),
                 "backward_compute_comm_overlap_time": max(0, b1 - c0)}
        d = self.data
        d.update(times)
        d.update(iteration=self._sampled, forward_compute_time_start=fwd0,
                 backward_compute_time_start=b0,
                 backward_compute_time_end=b1, backward_comm_time_start=c0,
                 backward_comm_time_end=c1)
        self._samples += 1
        for k, v in times.items():
            self._totals[k] += v
            d[f"avg_{k}"] = self._totals[k] // self._samples


# torch's logger names dtypes as C++ type names ("float", "double", "c10::Half").
_CPP_NAMES = {"float32": "float", "float64": "double", "float16": "c10::Half",
              "bfloat16": "c10::BFloat16",
              "int64": "long int", "int32": "int", "int16": "short int", "int8": "signed char",
              "uint8": "unsigned char", "bool": "bool", "complex64": "c10::complex<float>",
              "complex128": "c10::complex<double>"}


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return _CPP_NAMES.get(name, name)


def _sizes(reducer: Any) -> str:
    return ", ".join(str(b.plan.nbytes) for b in reducer.layout.buckets)


def _backend(pg: ProcessGroup) -> str:
    try:
        from ringlet.c10d.world import get_backend

        return str(get_backend(pg))
    except (RuntimeError, ValueError):
        return str(getattr(pg, "backend_name", "unknown"))
