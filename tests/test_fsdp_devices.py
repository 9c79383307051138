"""fully_shard's device decisions ([Note: FSDP devices] in ringlet/parallel/fsdp/_device.py).

No GPU here: the ``meta`` device plays the GPU.  ``_device.compute_device`` is patched to answer
``meta``, so a CPU model sharded on a CPU mesh computes "on the GPU": its parameters are moved
there as shards, its buffers too, and under ``CPUOffloadPolicy`` the shards stay on the CPU.  The
collectives are replaced by recorders (meta tensors carry no data, and the point is what each
collective is given), and the copy of a reduced shard back to the CPU by one that records its
input and returns known values, so that the optimizer's step on the CPU shards can be checked.
The real CUDA run is ``test_fully_shard_one_rank_on_cuda_matches_single_process`` in
tests/test_gpu.py (skipped without a device).
"""

from __future__ import annotations

import threading
import types
from typing import Any

import pytest
import torch
from _workers import seeded
from torch import nn

from ringlet.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from ringlet.mesh import DeviceMesh
from ringlet.parallel.fsdp import _collectives, _device, _mesh_info
from ringlet.parallel.fsdp._device import ShardHome
from ringlet.testing import run_threads

GPU = torch.device("meta")          # plays the CUDA device


class _Work:
    """An async collective's Work: reading its output before ``wait()`` is the bug we look for."""

    def __init__(self, output: torch.Tensor) -> None:
        self.output, self.waited = output, False

    def wait(self) -> bool:
        self.waited = True
        return True


@pytest.fixture
def stand_in_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """Compute on ``meta``; record every all-gather, reduce-scatter and copy back to the CPU."""
    seen: dict[str, list[Any]] = {"all_gather": [], "reduce_scatter": [], "to_cpu": [],
                                  "works": []}
    monkeypatch.setattr(_device, "compute_device", lambda mesh: GPU)

    def collective(op: str) -> Any:
        def call(output: torch.Tensor, source: torch.Tensor, *, group: Any = None,
                 async_op: bool = False, **kw: Any) -> Any:
            seen[op].append((source.device, source.dtype, output.device, output.dtype, async_op))
            if not async_op:
                return None
            work = _Work(output)
            seen["works"].append(work)
            return work
        return call
    monkeypatch.setattr(_collectives, "all_gather_into_tensor", collective("all_gather"))
    monkeypatch.setattr(_collectives, "reduce_scatter_tensor", collective("reduce_scatter"))

    read_out = _collectives.copy_out

    def copy_out(gathered: torch.Tensor, unsharded: torch.Tensor, layout: Any) -> None:
        pending = [w for w in seen["works"] if w.output is gathered and not w.waited]
        if pending:
            raise AssertionError("an all-gather's output was read before its work.wait()")
        read_out(gathered, unsharded, layout)
    monkeypatch.setattr(_collectives, "copy_out", copy_out)

    place = ShardHome.place

    def to_cpu(self: ShardHome, t: torch.Tensor) -> torch.Tensor:
        if t.device != GPU:
            return place(self, t)
        if any(not w.waited for w in seen["works"] if w.output is t):
            raise AssertionError("a reduce-scatter's output was read before its work.wait()")
        seen["to_cpu"].append((t.device, t.dtype, self.offload))
        return torch.full(t.shape, 0.5, dtype=t.dtype)       # the "reduced gradient"
    monkeypatch.setattr(ShardHome, "place", to_cpu)
    return seen


def _model() -> nn.Module:
    model = seeded(0, lambda: nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    model.register_buffer("scale", torch.ones(2))
    return model


def _local(p: Any) -> torch.Tensor:
    return p.to_local()


def _offloaded(rank: int, n: int, gpu_mesh: bool = False) -> dict[str, Any]:
    """``gpu_mesh``: the mesh then says it computes on the stand-in GPU too (as a CUDA mesh
    does), so the sharded DTensors' mesh and their offloaded CPU shards differ in device."""
    model = _model()
    before = [_shard(p.detach(), rank, n) for p in model.parameters()]
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    off = CPUOffloadPolicy(pin_memory=False)        # pinning needs CUDA
    for layer in (model[0], model[2]):
        fully_shard(layer, mp_policy=mp, offload_policy=off)
    fully_shard(model, mp_policy=mp, offload_policy=off)
    state = model[0]._get_fsdp_state()
    if gpu_mesh:
        state.group.mesh_info.mesh._device_type = "meta"
        model.float()          # module._apply rebuilds the sharded parameters on that mesh
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"home": repr(state.group.home), "buffer": model.scale.device,
           "shards": {_local(p).device for p in model.parameters()}}
    for device in (GPU, "cpu"):         # the second iteration prefetches in forward too
        y = model(torch.randn(3, 4, device=device))     # the root moves inputs to its device
        out["output"] = y.device
        y.sum().backward()
        out["grads"] = {(_local(p.grad).device, _local(p.grad).dtype) for p in model.parameters()}
        opt.step()
        opt.zero_grad()
    out["step"] = [(_local(p) - b).tolist() for p, b in zip(model.parameters(), before)]
    return out


def _shard(t: torch.Tensor, rank: int, n: int) -> torch.Tensor:
    return t.chunk(n)[rank].clone()


@pytest.mark.parametrize("gpu_mesh", [False, True], ids=["cpu-mesh", "gpu-mesh"])
def test_offloaded_shards_stay_on_the_cpu_and_collectives_run_on_the_gpu(
        stand_in_gpu: dict[str, list[Any]], gpu_mesh: bool) -> None:
    got = run_threads(_offloaded, 2, gpu_mesh)
    for r in got:
        assert r["home"] == "ShardHome(compute meta, shards offloaded to CPU)"
        assert r["shards"] == {torch.device("cpu")} and r["buffer"] == GPU
        assert r["output"] == GPU
        assert r["grads"] == {(torch.device("cpu"), torch.float32)}
        # two SGD steps of lr 0.1 on gradients of 0.5, on the CPU shards
        for delta in r["step"]:
            flat = torch.tensor(delta).flatten()
            torch.testing.assert_close(flat, torch.full_like(flat, -0.1))
    ag, rs = stand_in_gpu["all_gather"], stand_in_gpu["reduce_scatter"]
    # every all-gather is given the shard copied to the GPU, in the compute dtype
    assert ag and {a[:4] for a in ag} == {(GPU, torch.bfloat16, GPU, torch.bfloat16)}
    assert any(a[4] for a in ag), "no prefetch (async) all-gather was issued"
    assert rs and {r[:4] for r in rs} == {(GPU, torch.float32, GPU, torch.float32)}
    assert all(r[4] for r in rs)
    # each reduce-scatter's result goes back to the CPU: 2 groups x 2 ranks x 2 iterations
    assert stand_in_gpu["to_cpu"] == [(GPU, torch.float32, True)] * 8
    assert all(w.waited for w in stand_in_gpu["works"])


class _Copy:
    """A CUDA event's stand-in for a copy back to the CPU: the data arrives when it is waited
    for (until then the CPU tensor holds NaN, so a gradient read too early spoils the step)."""

    def __init__(self, dest: torch.Tensor, log: list[str]) -> None:
        self.dest, self.log = dest, log

    def synchronize(self) -> None:
        self.dest.fill_(0.5)                                  # the "reduced gradient"
        self.log.append("wait")


def test_offloaded_gradients_are_copied_during_backward_and_land_at_its_end(
        stand_in_gpu: dict[str, list[Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside backward the host only queues the copies of reduced shards to the CPU; it waits
    for them once, at the end of backward, and only then are they added into ``.grad``."""
    logs: dict[int, list[str]] = {}

    def send_home(self: ShardHome, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if t.device != GPU:
            return self.place(t), None
        log = logs.setdefault(threading.get_ident(), [])
        log.append("copy")
        dest = torch.full(t.shape, float("nan"), dtype=t.dtype)
        return dest, _Copy(dest, log)
    monkeypatch.setattr(ShardHome, "send_home", send_home)
    for r in run_threads(_offloaded, 2):
        assert r["grads"] == {(torch.device("cpu"), torch.float32)}
        for delta in r["step"]:                     # no NaN: nothing was read before its wait
            flat = torch.tensor(delta).flatten()
            torch.testing.assert_close(flat, torch.full_like(flat, -0.1))
    # 2 groups, 2 iterations per rank: both copies queued before the first wait of a backward
    assert list(logs.values()) == [["copy", "copy", "wait", "wait"] * 2] * 2


def _on_device(rank: int, n: int) -> tuple[Any, ...]:
    model = _model()
    fully_shard(model)
    group = model._get_fsdp_state().group
    return (repr(group.home), {_local(p).device for p in model.parameters()},
            group.shard_buffer.device, model.scale.device)


def test_cpu_parameters_move_to_the_compute_device_as_shards(
        stand_in_gpu: dict[str, list[Any]]) -> None:
    for home, shards, buffer, scale in run_threads(_on_device, 2):
        assert home == "ShardHome(compute meta, shards on device)"
        assert shards == {GPU} and buffer == GPU and scale == GPU


def _one_group(rank: int, n: int) -> Any:
    model = fully_shard(_model(), offload_policy=CPUOffloadPolicy(pin_memory=False))
    return model(torch.ones(1, 4)).device


def test_the_root_moves_its_inputs_to_the_compute_device(
        stand_in_gpu: dict[str, list[Any]]) -> None:
    """A CPU batch reaches the (stand-in) GPU; the root of _offloaded has no group of its own."""
    assert run_threads(_one_group, 2) == [GPU, GPU]


def _cpu_step(rank: int, n: int) -> list[float]:
    model = _model()
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return [float(_local(p).detach().sum()) for p in model.parameters()]


def test_the_cpu_path_makes_no_cuda_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU mesh nothing asks CUDA anything (no host sync, no pinning, no stream)."""
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a CUDA call on the CPU path")
    for name in ("current_device", "current_stream", "synchronize", "Stream", "Event"):
        monkeypatch.setattr(torch.cuda, name, refuse)
    for name in ("pin_memory", "is_pinned", "record_stream"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    a, b = run_threads(_cpu_step, 2)
    assert len(a) == len(b) == 4


def test_default_mesh_is_cuda_when_cuda_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """No mesh: torch's rule, a CUDA mesh whenever CUDA is available (a CPU model then moves to
    the GPU), else a CPU one; the mesh spans the default world."""
    asked: list[tuple[str, tuple[int, ...]]] = []

    def init_device_mesh(kind: str, shape: tuple[int, ...]) -> Any:
        asked.append((kind, shape))
        return DeviceMesh("cpu", [0])

    monkeypatch.setattr(_mesh_info, "init_device_mesh", init_device_mesh)
    monkeypatch.setattr(_mesh_info, "joined_world", lambda kind: types.SimpleNamespace(
        world_size=3))

    def resolve(rank: int, n: int) -> None:
        _mesh_info.resolve_mesh(None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        _mesh_info.resolve_mesh(None)
    run_threads(resolve, 1)
    assert asked == [("cpu", (3,)), ("cuda", (3,))]


def test_a_mesh_of_another_device_type_is_refused() -> None:
    def body(rank: int, n: int) -> None:
        mesh = DeviceMesh("cpu", [0])
        mesh._device_type = "xpu"
        with pytest.raises(ValueError, match="expected device type 'cpu' or 'cuda', got 'xpu'"):
            fully_shard(nn.Linear(2, 2), mesh=mesh)
    run_threads(body, 1)


def test_move_buffers_leaves_managed_submodules_alone() -> None:
    inner, outer = nn.BatchNorm1d(2), nn.Sequential(nn.BatchNorm1d(2), nn.Linear(2, 2))
    outer.append(inner)
    inner.__dict__["_fsdp_state"] = object()            # placed by its own fully_shard call
    _device.move_buffers([outer], GPU)
    assert outer[0].running_mean.device == GPU
    assert inner.running_mean.device == torch.device("cpu")


def _deferred(rank: int, n: int) -> tuple[Any, ...]:
    with torch.device("meta"):
        model = _model()
    fully_shard(model, offload_policy=CPUOffloadPolicy(pin_memory=False))
    group = model._get_fsdp_state().group
    before = group.shard_buffer.device
    model.to_empty(device="cpu")            # materialise the offloaded shards where they live
    model.to(torch.float64)
    return before, repr(group.home), group.shard_buffer.device, group.shard_buffer.dtype


def test_offloaded_shards_materialise_on_the_cpu_and_compute_stays_on_the_gpu(
        stand_in_gpu: dict[str, list[Any]]) -> None:
    for before, home, after, dtype in run_threads(_deferred, 2):
        assert before == torch.device("meta")
        assert home == "ShardHome(compute meta, shards offloaded to CPU)"
        assert after == torch.device("cpu") and dtype == torch.float64


def test_an_unmaterialised_group_names_the_device_to_materialise_on() -> None:
    def body(rank: int, n: int) -> None:
        model = nn.Linear(2, 2, device="meta")
        fully_shard(model)
        with pytest.raises(RuntimeError, match=r"to_empty\(device='cpu'\)"):
            model(torch.randn(1, 2))
    run_threads(body, 1)
