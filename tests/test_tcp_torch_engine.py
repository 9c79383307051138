"""The torch-engine adapter: torch's gloo (CPU) and NCCL (CUDA) process groups under ringlet's API.

NCCL needs a GPU: on a machine without one, asking for it fails with a clear message and the NCCL
tests are skipped, saying so."""

from __future__ import annotations

import _tcp_workers
import pytest
import torch

import ringlet.distributed as dist
from ringlet.store import HashStore
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport.base import OpContext, Transport
from ringlet.transport.reduce import RedOpType
from ringlet.transport.split import DeviceSplitTransport
from ringlet.transport.torch_engine import engines_for

NO_CUDA = ("no CUDA device here: torch's NCCL engine cannot run (the adapter refuses it with a "
           "clear error)")


@pytest.mark.timeout(30)
def test_engine_specs() -> None:
    assert engines_for("torch:gloo") == {"cpu": "gloo"}
    assert engines_for("torch:nccl") == {"cuda": "nccl"}
    assert engines_for("torch:gloo,nccl") == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match="expected gloo or nccl"):
        engines_for("torch:mpi")


@pytest.mark.timeout(120)
def test_collectives_on_torchs_gloo_through_ringlets_api() -> None:
    for got in raise_first(run_world(2, _tcp_workers.engine_cases, backend="torch:gloo",
                                     timeout=90)):
        assert got["backend"] == "torch:gloo"
        assert got["bad"] == [], got["bad"]


@pytest.mark.timeout(60)
def test_torchs_timeout_becomes_a_collective_timeout_error() -> None:
    res = raise_first(run_world(2, _tcp_workers.engine_timeout, backend="torch:gloo",
                                op_timeout=1.5, timeout=30))
    assert res[0][0] == "CollectiveTimeoutError" and "gloo" in res[0][1], res[0]


@pytest.mark.timeout(30)
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="this machine has CUDA: the NCCL tests below run")
def test_nccl_without_cuda_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="needs CUDA"):
        dist.init_process_group("torch:nccl", store=HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("spec", ["torch:nccl", "torch:gloo,nccl"])
def test_nccl_engine_on_one_gpu(spec: str) -> None:
    """World of one (one GPU), in a child process: NCCL keeps process-wide listeners alive."""
    assert (raise_first(run_world(1, _tcp_workers.nccl_one_gpu, spec, backend="tcp", timeout=100))
            == ["ok"])


# ---------------------------------------------------------------- per-device: ringlet for CPU, NCCL
# for CUDA


class _Recorder(Transport):
    """Stands in for a transport: records which calls reached it."""

    def __init__(self, devices: tuple[str, ...]) -> None:
        self.devices = devices
        self.calls: list[str] = []
        self.aborted: str | None = None
        self.closed = False

    def all_reduce(self, buf, op, factor, ctx):  # type: ignore[no-untyped-def]
        self.calls.append(f"all_reduce {buf.device.type}")

    def all_gather(self, inp, out, ctx):  # type: ignore[no-untyped-def]
        self.calls.append(f"all_gather {inp.device.type}")

    def scatter(self, inp, out, root, ctx):  # type: ignore[no-untyped-def]
        self.calls.append(f"scatter {out.device.type}")

    def barrier(self, ctx):  # type: ignore[no-untyped-def]
        self.calls.append("barrier")

    def send(self, buf, dst, tag, ctx):  # type: ignore[no-untyped-def]
        self.calls.append(f"send {buf.device.type}")

    def abort(self, reason: str) -> None:
        self.aborted = reason

    def close(self) -> None:
        self.closed = True

    reduce = broadcast = gather = reduce_scatter = all_to_all = recv = None  # type: ignore[assignment]


@pytest.mark.timeout(30)
def test_split_transport_sends_each_call_to_its_devices_transport() -> None:
    """The dispatch of ``cpu:X,cuda:nccl`` groups, with 'meta' tensors standing in for CUDA ones
    (this machine has no GPU); the second transport is built at its first tensor, once."""
    cpu = _Recorder(("cpu",))
    built: list[_Recorder] = []

    def make() -> _Recorder:
        built.append(_Recorder(("meta",)))
        return built[-1]
    tr = DeviceSplitTransport(cpu, {"meta": make}, "shm,meta:test")
    assert tr.devices == ("cpu", "meta") and not built
    ctx = OpContext("all_reduce", 1, 0, 2, "g", 5.0, torch.float32, 4, -1, 0)
    tr.all_reduce(torch.ones(4), RedOpType.SUM, None, ctx)
    assert not built                                   # nothing built before a 'meta' tensor
    tr.all_reduce(torch.ones(4, device="meta"), RedOpType.SUM, None, ctx)
    tr.all_gather(torch.ones(2, device="meta"), torch.empty(4, device="meta"), ctx)
    tr.scatter(None, torch.empty(2), 0, ctx)
    tr.send(torch.ones(1, device="meta"), 1, 0, ctx)
    tr.barrier(ctx)
    assert len(built) == 1
    assert cpu.calls == ["all_reduce cpu", "scatter cpu", "barrier"]
    assert built[0].calls == ["all_reduce meta", "all_gather meta", "send meta"]
    with pytest.raises(ValueError, match=r"serves \['cpu', 'meta'\] tensors, got one on cuda"):
        tr.all_reduce(_FakeDevice("cuda"), RedOpType.SUM, None, ctx)  # type: ignore[arg-type]
    tr.abort("stop")
    tr.close()
    assert cpu.aborted == built[0].aborted == "stop" and cpu.closed and built[0].closed


class _FakeDevice:
    """A tensor-like object on a device type nobody serves."""

    def __init__(self, kind: str) -> None:
        self.device = torch.device(kind)


@pytest.mark.timeout(60)
def test_per_device_backend_runs_cpu_tensors_on_ringlet_and_builds_nccl_only_when_asked() -> None:
    """torch's own spelling ``cpu:gloo,cuda:nccl`` on a machine without a GPU: CPU collectives run
    on
    ringlet's shm, and the NCCL side is not built (it waits for a CUDA tensor)."""
    for got in raise_first(run_world(2, _tcp_workers.per_device_cpu, backend="cpu:gloo,cuda:nccl",
                                     timeout=50)):
        assert got == {"backend": "cpu:gloo,cuda:nccl",
                       "transport": "shm,cuda:torch:nccl", "sum": 3.0,
                       "built": ["cpu"], "devices": ["cpu", "cuda"]}, got


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_per_device_backend_on_one_gpu() -> None:
    """``cpu:shm,cuda:nccl``: CPU tensors through ringlet's shm, CUDA tensors through torch's
    NCCL."""
    assert raise_first(run_world(1, _tcp_workers.per_device_gpu, backend="cpu:shm,cuda:nccl",
                                 timeout=100)) == ["ok"]
