"""GPUs (issue 20, docs/gpu.md): what can be checked without one, and the GPU tests.

On CPU machines the CUDA stream and event calls of [Note: CUDA streams] are replaced by a recorder
(``_cuda.api``) and the CPU plays the CUDA device type (``_cuda.DEVICE_TYPES``), served by a fake
transport that records which stream each call ran on: the ordering protocol is checked call by
call.  The pure device rules (DDP's ``device_ids``/``output_device``, ``device_id=``, the FSDP shard
home, backend names) run as they are.  The tests marked ``NEEDS_CUDA`` skip without a device.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import _gpu_workers
import pytest
import torch
from torch import nn

import ringlet.distributed as dist
from ringlet.c10d import _cuda
from ringlet.c10d.work import Work
from ringlet.errors import DistBackendError
from ringlet.nn.parallel import DistributedDataParallel
from ringlet.parallel._device_moves import move_to
from ringlet.parallel.ddp._cuda import aux_device, plan_devices
from ringlet.parallel.fsdp._device import ShardHome, compute_device, default_mesh_type
from ringlet.parallel.fsdp.policies import CPUOffloadPolicy, OffloadPolicy
from ringlet.store import HashStore
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport import selection
from ringlet.transport.base import Transport

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
META = torch.device("meta")
GPU = torch.device("cpu")        # plays the CUDA device in the stream tests


# --- the recorder: CUDA streams and events as names, per thread ------------------------------

class Recorder(_cuda.StreamAPI):
    """Streams are names (``main`` is every thread's current stream); every call is logged as a
    tuple.  Events are ``E0``, ``E1``...; ``finished`` holds the ones that completed."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.finished: set[str] = set()
        self._local = threading.local()
        self._n = 0

    def _stack(self) -> list[str]:
        if not hasattr(self._local, "stack"):
            self._local.stack = ["main"]
        return self._local.stack

    def current(self, device: torch.device) -> str:
        return self._stack()[-1]

    def new_stream(self, device: torch.device) -> str:
        self.log.append(("new_stream", str(device)))
        return "side"

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[Any]:
        self._stack().append(stream)
        try:
            yield stream
        finally:
            self._stack().pop()

    def record(self, stream: Any) -> str:
        event = f"E{self._n}"
        self._n += 1
        self.log.append(("record", stream, event))
        return event

    def wait_event(self, stream: Any, event: Any) -> None:
        self.log.append(("wait_event", stream, event))

    def wait_stream(self, stream: Any, other: Any) -> None:
        self.log.append(("wait_stream", stream, other))

    def done(self, event: Any) -> bool:
        return event in self.finished

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        self.log.append(("record_stream", tuple(tensor.shape), stream))

    def future(self, device: torch.device) -> torch.futures.Future:
        self.log.append(("future", str(device)))
        return torch.futures.Future()


def _fake_transport(stream_ordered: tuple[str, ...], rec: Recorder) -> type[Transport]:
    """A one-rank transport that logs each call with the stream current in it."""

    def note(op: str) -> Any:
        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            rec.log.append(("call", op, rec.current(GPU)))
            return 0 if op == "recv" else None
        return call
    ops = ("all_reduce", "reduce", "broadcast", "all_gather", "gather", "scatter",
           "reduce_scatter", "all_to_all", "barrier", "send", "recv")
    body: dict[str, Any] = {op: note(op) for op in ops}
    body.update(name="fake-gpu", devices=("cpu",), stream_ordered=stream_ordered,
                rank=0, world_size=1, abort=lambda self, reason: None, close=lambda self: None)
    return type("FakeGpuTransport", (Transport,), body)


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``start(stream_ordered)``: a one-rank world whose 'GPU' is the CPU; the recorder."""
    rec = Recorder()
    monkeypatch.setattr(_cuda, "api", rec)
    monkeypatch.setattr(_cuda, "DEVICE_TYPES", ("cpu",))

    def start(stream_ordered: tuple[str, ...]) -> Recorder:
        cls = _fake_transport(stream_ordered, rec)
        selection.register_transport("fakegpu", lambda store, rank, n, timeout: cls())
        dist.init_process_group("fakegpu", store=HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=10))
        rec.log.clear()
        return rec
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()
    selection._registry.pop("fakegpu", None)


# --- [Note: CUDA streams], stream-ordered transports (torch's NCCL) -------------------------------

def test_sync_collective_runs_on_the_current_stream(fake_gpu: Any) -> None:
    rec = fake_gpu(("cpu",))
    assert dist.all_reduce(torch.empty(4, device=GPU)) is None
    assert rec.log == [("call", "all_reduce", "main")]          # no side stream, no event


def test_cpu_collectives_make_no_stream_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = Recorder()
    monkeypatch.setattr(_cuda, "api", rec)
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(2)
        dist.all_reduce(t)
        dist.all_reduce(t, async_op=True).wait()
        assert rec.log == [] and not dist.group.WORLD._accel
    finally:
        dist.destroy_process_group()


def test_async_collective_runs_on_the_side_stream_after_the_callers(fake_gpu: Any) -> None:
    rec = fake_gpu(("cpu",))
    t = torch.empty(4, device=GPU)
    work = dist.all_reduce(t, async_op=True)
    assert rec.log == [("new_stream", "cpu"),
                       ("wait_stream", "side", "main"),          # inputs after the caller's kernels
                       ("call", "all_reduce", "side"),
                       ("record", "side", "E0"),
                       ("record_stream", (4,), "side")]          # kept from the caching allocator
    rec.log.clear()
    assert not work.is_completed()
    with rec.use("compute"):
        assert work.wait() is True                               # no host wait without a timeout
    assert rec.log == [("wait_event", "compute", "E0")]          # the stream current *then* waits
    rec.finished.add("E0")
    assert work.is_completed() and work.is_success()
    dist.all_reduce(t, async_op=True)                            # the side stream is reused
    assert ("new_stream", "cpu") not in rec.log


def test_async_wait_with_a_timeout_blocks_until_the_event_and_names_the_op(fake_gpu: Any) -> None:
    rec = fake_gpu(("cpu",))
    work = dist.all_reduce(torch.empty(2, device=GPU), async_op=True)
    with pytest.raises(DistBackendError, match=r"all_reduce #\d+ did not complete on cpu"):
        work.wait(timeout=timedelta(milliseconds=20))
    rec.finished.add("E0")
    assert work.wait(timeout=5.0) is True


def test_async_future_is_completed_on_the_side_stream(fake_gpu: Any) -> None:
    rec = fake_gpu(("cpu",))
    t = torch.empty(3, device=GPU)
    fut = dist.all_reduce(t, async_op=True).get_future()
    assert ("future", "cpu") in rec.log and fut.done()
    assert len(fut.value()) == 1 and fut.value()[0] is t     # torch's: [tensor]


def test_async_all_gather_keeps_inputs_and_outputs_alive(fake_gpu: Any) -> None:
    rec = fake_gpu(("cpu",))
    out, inp = torch.empty(4, device=GPU), torch.empty(4, device=GPU)
    dist.all_gather_into_tensor(out, inp, async_op=True)
    kept = [e for e in rec.log if e[0] == "record_stream"]
    assert len(kept) == 2 and all(e[2] == "side" for e in kept)


def test_p2p_on_a_stream_ordered_transport_runs_on_the_side_stream(fake_gpu: Any) -> None:
    rec = fake_gpu(("cpu",))
    pg = dist.group.WORLD
    work = pg.run_p2p(lambda w: pg.transport.send(None, 0, 0, None), 0, "send",
                      _ctx("send"), torch.empty(2, device=GPU))
    assert rec.log[-4:] == [("wait_stream", "side", "main"), ("call", "send", "side"),
                            ("record", "side", "E0"), ("record_stream", (2,), "side")]
    assert isinstance(work, _cuda.StreamWork)


# --- staged transports (ringlet's, through host memory) ------------------------------------------

def test_staged_sync_collective_waits_for_an_event_of_the_callers_stream(fake_gpu: Any) -> None:
    rec = fake_gpu(())
    dist.all_reduce(torch.empty(4, device=GPU))
    assert rec.log == [("record", "main", "E0"),                 # at issue, on the caller's stream
                       ("new_stream", "cpu"),
                       ("wait_event", "side", "E0"),
                       ("call", "all_reduce", "side")]


def test_staged_async_records_at_issue_and_runs_later_after_the_event(fake_gpu: Any) -> None:
    rec = fake_gpu(())
    gate = threading.Event()
    pg = dist.group.WORLD
    # holds the communication thread's queue (a one-rank group runs an async op inline only
    # when nothing is queued)
    blocker = Work(op="blocker")
    pg._executor.submit(lambda: gate.wait(5), blocker)
    try:
        work = dist.all_reduce(torch.empty(4, device=GPU), async_op=True)
        assert rec.log == [("record", "main", "E0"), ("new_stream", "cpu")]   # nothing ran yet
    finally:
        gate.set()
    assert work.wait(timeout=5) and blocker.wait(timeout=5)
    assert rec.log[2:] == [("wait_event", "side", "E0"), ("call", "all_reduce", "side")]
    assert not isinstance(work, _cuda.StreamWork)                # the host-side Work orders it


def _ctx(op: str) -> Any:
    from ringlet.transport.base import OpContext

    ctx = OpContext.__new__(OpContext)
    for slot in OpContext.__slots__:
        setattr(ctx, slot, None)
    ctx.op, ctx.seq, ctx.numel, ctx.root = op, 10_000, 0, 0
    return ctx


# --- init_process_group(device_id=) --------------------------------------------------------------

@pytest.mark.parametrize("bad, error, text", [
    (True, TypeError, "expected a torch.device or a CUDA device index, got True"),
    ("cuda:0", TypeError, "got 'cuda:0'"),
    (torch.device("meta"), ValueError, "expected a CUDA device"),
    (torch.device("cuda"), ValueError, "expected a CUDA device with an index below"),
])
def test_bind_device_refuses_what_is_not_a_cuda_device_of_this_host(bad: Any, error: type,
                                                                     text: str) -> None:
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        _cuda.bind_device(bad, "init_process_group")


def test_bind_device_none_and_cpu_bind_nothing() -> None:
    assert _cuda.bind_device(None, "x") is None
    assert _cuda.bind_device(torch.device("cpu"), "x") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
def test_device_id_index_without_cuda_is_refused_before_the_group_exists() -> None:
    with pytest.raises(ValueError, match=r"init_process_group: device_id: .* below 0 .* got 0"):
        dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1, device_id=0)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cpu"))
    try:
        assert dist.group.WORLD.bound_device_id is None
    finally:
        dist.destroy_process_group()


# --- DDP: device_ids / output_device (torch's rules and messages) ---------------------------------

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def test_plan_devices_cpu_module_takes_no_device_ids() -> None:
    plan = plan_devices([torch.device("cpu")] * 3, None, None)
    assert (plan.device, plan.device_ids, plan.output_device) == (torch.device("cpu"), None, None)
    for ids, out in (([0], None), (None, 0)):
        with pytest.raises(ValueError, match="device_ids and output_device arguments only work "
                                             "with single-device/multiple-device GPU modules or "
                                             "CPU modules"):
            plan_devices([torch.device("cpu")], ids, out)
    with pytest.raises(ValueError, match=r"^device_ids can only be None or contain a single "
                                         r"element\.$"):
        plan_devices([CUDA0], [0, 1], None)


def test_plan_devices_cuda_module() -> None:
    assert plan_devices([CUDA1, CUDA1], [1], None).output_device == 1      # defaults to the id
    assert plan_devices([CUDA1], [CUDA1], "cuda:0").output_device == 0
    assert plan_devices([CUDA1], ["cuda:1"], None).device_ids == [1]
    plan = plan_devices([CUDA1], None, None)                   # ids are optional: nothing moved
    assert (plan.device, plan.device_ids, plan.output_device) == (CUDA1, None, None)
    with pytest.raises(ValueError, match=r"device_ids: expected \[1\] .* on cuda:1\), got \[0\]"):
        plan_devices([CUDA1], [0], None)
    with pytest.raises(ValueError, match="expected a device with an index, got cuda"):
        plan_devices([CUDA1], [torch.device("cuda")], None)
    with pytest.raises(TypeError, match="output_device: expected a device index or torch.device"):
        plan_devices([CUDA1], [1], 1.5)
    plan = plan_devices([CUDA0, CUDA1], None, None)            # spread over devices
    assert plan.device is None and plan.device_ids is None
    with pytest.raises(ValueError, match="module parameters"):
        plan_devices([CUDA0, CUDA1], [0], None)


def test_ddp_refuses_device_ids_for_a_cpu_module() -> None:
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="device_ids and output_device arguments only work"):
            DistributedDataParallel(nn.Linear(2, 2), device_ids=[0])
        ddp = DistributedDataParallel(nn.Linear(2, 2))
        assert ddp.device_ids is None and ddp.output_device is None
    finally:
        dist.destroy_process_group()


def test_move_to_moves_every_tensor_and_keeps_containers() -> None:
    from collections import namedtuple

    Pair = namedtuple("Pair", "a b")
    here = torch.ones(2, device=META)
    obj = (torch.ones(1), [torch.zeros(2), 3, "s"], {"k": Pair(torch.ones(3), None)}, here)
    moved = move_to(obj, META)
    assert type(moved) is tuple and type(moved[2]["k"]) is Pair
    assert moved[0].device == META and moved[1][0].device == META and moved[2]["k"].a.device == META
    assert moved[1][1:] == [3, "s"] and moved[2]["k"].b is None
    assert moved[3] is here                                    # already there: not copied


def test_aux_device_stays_on_the_cpu_where_the_group_serves_cpu() -> None:
    class G:
        def __init__(self, devices: tuple[str, ...]) -> None:
            self.transport = type("T", (), {"devices": devices})()
    assert aux_device(G(("cpu", "cuda")), CUDA0) == torch.device("cpu")
    assert aux_device(G(("cuda",)), CUDA0) == CUDA0              # a bare torch:nccl group
    assert aux_device(G(("cuda",)), None) == torch.device("cpu")


# --- fully_shard's devices ([Note: FSDP devices]) ------------------------------------------------

def test_shard_home_offloads_only_from_a_gpu() -> None:
    on_cpu = ShardHome(torch.device("cpu"), CPUOffloadPolicy())
    assert not on_cpu.offload and on_cpu.home == torch.device("cpu")
    gpu = ShardHome(CUDA0, CPUOffloadPolicy(pin_memory=True))
    assert gpu.offload and gpu.pin and gpu.home == torch.device("cpu")
    assert "offloaded to pinned CPU" in repr(gpu)
    unpinned = ShardHome(CUDA0, CPUOffloadPolicy(pin_memory=False))
    z = unpinned.zeros(5, torch.float32, meta=False)
    assert z.device.type == "cpu" and z.shape == (5,) and not z.is_pinned()
    assert unpinned.zeros(5, torch.float32, meta=True).device == META
    assert unpinned.place(z) is z                              # already home
    plain = ShardHome(CUDA0, OffloadPolicy())
    assert not plain.offload and plain.home == CUDA0 and "on device" in repr(plain)
    assert gpu.rebind(z) is gpu                                # offloaded shards stay offloaded
    moved = ShardHome(torch.device("cpu"), None).rebind(torch.empty(1, device=META))
    assert moved.home == torch.device("cpu")


def test_default_mesh_type_and_compute_device() -> None:
    assert default_mesh_type() == ("cuda" if torch.cuda.is_available() else "cpu")
    assert compute_device(type("M", (), {"device_type": "cpu"})()) == torch.device("cpu")
    assert compute_device(object()) == torch.device("cpu")


# --- backend names, 2 processes, CPU tensors -----------------------------------------------------

@pytest.mark.parametrize("name, canonical", [
    ("nccl", "auto,cuda:nccl"), ("NCCL", "auto,cuda:nccl"), ("cuda:nccl", "auto,cuda:nccl"),
    ("cpu:gloo,cuda:nccl", "auto,cuda:nccl"), ("cpu:shm,cuda:nccl", "shm,cuda:nccl"),
    ("gloo", "auto"), ("cpu:torch:gloo,cuda:torch:nccl", "torch:gloo,nccl"),
])
def test_parse_backend_names_as_torch_spells_them(name: str, canonical: str) -> None:
    assert selection.parse_backend(name) == canonical


@pytest.mark.parametrize("bad, text", [("cpu:nccl", "nccl serves CUDA tensors"),
                                       ("cuda:gloo", "cuda: expected 'nccl'"),
                                       ("gpu:nccl", "expected one of")])
def test_parse_backend_refuses(bad: str, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        selection.parse_backend(bad)


@pytest.mark.timeout(60)
def test_nccl_names_run_cpu_collectives_on_ringlet_and_answer_the_users_name() -> None:
    """'nccl' on a machine with or without a GPU: CPU tensors go to ringlet's shm (torch's
    'nccl' would refuse them); groups made with torch's other spellings do the same."""
    for got in raise_first(run_world(2, _gpu_workers.nccl_names_on_cpu, backend="nccl",
                                     timeout=50)):
        assert got == {"nccl": ("nccl", 3.0, "shm,cuda:torch:nccl"),
                       "cuda:nccl": ("cuda:nccl", 3.0, "shm,cuda:torch:nccl"),
                       "cpu:gloo,cuda:nccl": ("cpu:gloo,cuda:nccl", 3.0, "shm,cuda:torch:nccl")}


# --- on a GPU (skipped without one; none of these has run yet) ------------------------------------

@NEEDS_CUDA
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_ddp_one_rank_on_cuda_matches_single_process(backend: str) -> None:
    assert raise_first(run_world(1, _gpu_workers.ddp_vs_local, backend=backend,
                                 timeout=100)) == ["ok"]


@NEEDS_CUDA
@pytest.mark.timeout(120)
def test_two_ranks_share_a_gpu_with_gloo_staging() -> None:
    """Collectives (sync and async) and DDP on CUDA tensors, 2 ranks on cuda:0, staged."""
    assert raise_first(run_world(2, _gpu_workers.shared_gpu, backend="gloo",
                                 timeout=100)) == ["ok", "ok"]


@NEEDS_CUDA
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["cuda", "offload", "cpu-model", "cpu-default"])
def test_fully_shard_one_rank_on_cuda_matches_single_process(how: str) -> None:
    """A CUDA model (default mesh), the same offloaded to pinned CPU memory, a CPU model on a
    CUDA mesh or on the default mesh (a CUDA one, as torch's): the losses of the same training
    in one process (tests/test_fsdp_devices.py checks the device decisions without a GPU)."""
    dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
    try:
        assert _gpu_workers.fsdp_vs_local(0, 1, how) == "ok"
    finally:
        dist.destroy_process_group()


@NEEDS_CUDA
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, n", [("nccl", 1), ("gloo", 2)], ids=["nccl-1", "staged-2"])
def test_fully_shard_mixed_precision_on_cuda(backend: str, n: int) -> None:
    """MixedPrecisionPolicy on the GPU: bf16 compute, fp32 shards and reduce-scatter."""
    assert raise_first(run_world(n, _gpu_workers.fsdp_mixed_precision, backend=backend,
                                 timeout=100)) == ["ok"] * n


@pytest.mark.timeout(60)
def test_the_mixed_precision_worker_holds_on_the_cpu() -> None:
    """Its CPU twin (bf16 on the CPU, 2 ranks), so that the GPU run checks the GPU, not the
    test."""
    assert raise_first(run_world(2, _gpu_workers.fsdp_mixed_precision, "cpu",
                                 timeout=50)) == ["ok"] * 2


@NEEDS_CUDA
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, n", [("nccl", 1), ("gloo", 2)], ids=["nccl-1", "staged-2"])
def test_fully_shard_with_float16_autocast_grad_scaler_and_fused_adamw(backend: str,
                                                                       n: int) -> None:
    assert raise_first(run_world(n, _gpu_workers.fsdp_amp_vs_local, backend=backend,
                                 timeout=100)) == ["ok"] * n


@pytest.mark.timeout(90)
def test_the_cuda_hook_and_batchnorm_workers_hold_on_the_cpu() -> None:
    """The bodies of the two CUDA tests below, run with CPU tensors on 2 processes: the
    comparisons themselves hold (on a GPU only the device changes)."""
    for losses in raise_first(run_world(2, _gpu_workers.cpu_twins, backend="gloo", timeout=80)):
        assert len(losses) == 3 and all(len(run) == _gpu_workers.STEPS for run in losses)


@NEEDS_CUDA
@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend, n", [("nccl", 1), ("gloo", 2)], ids=["nccl-1", "staged-2"])
@pytest.mark.parametrize("hook", ["fp16", "bf16", "powersgd"])
def test_ddp_comm_hooks_on_cuda_match_the_cpu(backend: str, n: int, hook: str) -> None:
    for losses in raise_first(run_world(n, _gpu_workers.hooks_vs_cpu, hook, backend=backend,
                                        timeout=140)):
        assert losses[-1] < losses[0], losses


@NEEDS_CUDA
@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend, n", [("nccl", 1), ("gloo", 2)], ids=["nccl-1", "staged-2"])
def test_sync_batchnorm_on_cuda_matches_batchnorm_over_the_whole_batch(backend: str,
                                                                       n: int) -> None:
    assert raise_first(run_world(n, _gpu_workers.sync_batchnorm_vs_local, backend=backend,
                                 timeout=110)) == ["ok"] * n


@NEEDS_CUDA
@pytest.mark.timeout(150)
@pytest.mark.parametrize("backend, n", [("nccl", 1), ("gloo", 2)], ids=["nccl-1", "staged-2"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tensor_parallel_on_cuda_matches_one_process(backend: str, n: int, sp: bool) -> None:
    """The Llama of tests/test_tp_llama.py on a CUDA mesh (2 ranks share the GPU through
    staging); tests/test_dtensor_devices.py checks where tensors go without a GPU."""
    import _tp_workers

    for r in raise_first(run_world(n, _tp_workers.llama_parity, sp, 10, "cuda", backend=backend,
                                   timeout=140)):
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-4)
        assert r["param_diff"] < 1e-3, r["param_diff"]


@NEEDS_CUDA
@pytest.mark.timeout(200)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_tensor_parallel_with_data_parallel_on_cuda_matches_one_process(strategy: str) -> None:
    """TP + SP on "tp" and DDP or fully_shard on "dp" of a 2 x 2 CUDA mesh, 4 ranks sharing
    the GPU through staging."""
    import _tp_workers

    res = raise_first(run_world(4, _tp_workers.llama_2d, strategy, 5, "cuda", backend="gloo",
                                timeout=190))
    for dp0, dp1 in ((res[0], res[2]), (res[1], res[3])):
        means = [(a + b) / 2 for a, b in zip(dp0["losses"], dp1["losses"])]
        assert means == pytest.approx(dp0["ref_losses"], abs=1e-4)
    assert max(r["param_diff"] for r in res) < 1e-3
