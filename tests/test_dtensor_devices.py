"""Where DTensor and tensor parallelism put tensors: on the device their mesh computes on.

torch's rule, kept here: ``distribute_tensor``, ``DTensor.from_local`` (and so
``distribute_module``, ``parallelize_module`` and the parallel styles' input preparation) copy a
tensor of another device type to the mesh's device; ``meta`` tensors stay where they are
(deferred initialisation); a tensor already there is used as it is.

No GPU here: a one-rank mesh whose device type is patched to ``meta`` plays a CUDA mesh (a
one-rank mesh moves no data, so nothing has to compute on ``meta`` but the local ops).  The
same paths on a real GPU: ``test_tensor_parallel_on_cuda_matches_one_process`` in
tests/test_gpu.py and the tensor-parallel rows of scripts/gpu_check.py.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from ringlet.distributed.tensor import ones as dt_ones
from ringlet.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from ringlet.mesh.device_mesh import compute_device
from ringlet.testing import run_threads

META = torch.device("meta")


def _meta_mesh() -> Any:
    """A one-rank mesh that says it computes on ``meta`` (the stand-in for ``cuda``)."""
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    mesh._device_type = "meta"
    return mesh


def _on_one_rank(fn: Any) -> Any:
    return run_threads(lambda rank, n: fn(), 1, timeout=30)[0]


def test_compute_device_of_a_cpu_mesh_and_of_the_stand_in() -> None:
    def body() -> tuple[Any, Any]:
        return compute_device(init_device_mesh("cpu", (1,))), compute_device(_meta_mesh())
    assert _on_one_rank(body) == (torch.device("cpu"), META)


def test_distribute_tensor_copies_a_cpu_tensor_to_the_mesh_device() -> None:
    def body() -> None:
        mesh = _meta_mesh()
        src = torch.arange(8.0).reshape(4, 2).requires_grad_()
        for pls in ([Shard(0)], [Replicate()], [Shard(1)]):
            dt = distribute_tensor(src, mesh, pls)
            assert dt.to_local().device == META and dt.device == META, pls
            assert dt.shape == (4, 2) and dt.requires_grad and dt.is_leaf
        assert src.device.type == "cpu"                    # the caller's tensor is untouched
    _on_one_rank(body)


def test_from_local_copies_to_the_mesh_device_and_keeps_the_graph() -> None:
    def body() -> None:
        mesh = _meta_mesh()
        x = torch.ones(2, 3, requires_grad=True)
        dt = DTensor.from_local(x, mesh, [Shard(0)])
        assert dt.to_local().device == META
        assert dt.grad_fn is not None                       # differentiable back to x
    _on_one_rank(body)


def test_meta_tensors_stay_and_tensors_already_there_are_not_copied() -> None:
    def body() -> None:
        cpu_mesh = init_device_mesh("cpu", (1,))
        deferred = torch.empty(4, 2, device=META)
        assert distribute_tensor(deferred, cpu_mesh, [Shard(0)]).to_local().device == META
        x = torch.ones(2, 3)
        assert DTensor.from_local(x, cpu_mesh, [Shard(0)]).to_local().data_ptr() == x.data_ptr()
    _on_one_rank(body)


def test_factories_make_their_local_tensors_on_the_mesh_device() -> None:
    def body() -> None:
        dt = dt_ones(4, 2, device_mesh=_meta_mesh(), placements=[Shard(0)])
        assert dt.to_local().device == META
    _on_one_rank(body)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(4, 6), nn.Linear(6, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) * self.scale


def test_distribute_module_replicates_parameters_and_buffers_onto_the_mesh_device() -> None:
    def body() -> None:
        net = distribute_module(_Net(), _meta_mesh())
        for name, t in [*net.named_parameters(), *net.named_buffers()]:
            assert isinstance(t, DTensor) and t.to_local().device == META, name
    _on_one_rank(body)


def test_parallelize_module_moves_a_cpu_model_to_the_mesh_device() -> None:
    """torch's tutorials parallelize a model built on the CPU onto a CUDA mesh: the sharded
    weights land on the GPU; the input prepared by ColwiseParallel follows them."""
    def body() -> None:
        net = parallelize_module(_Net(), _meta_mesh(),
                                 {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for name, p in net.named_parameters():
            assert isinstance(p, DTensor) and p.to_local().device == META, name
        assert net.scale.device.type == "cpu"              # not in the plan: left where it was
        out = net.up(torch.ones(3, 4))                      # a CPU input goes to the mesh device
        assert out.device == META and out.shape == (3, 6)
    _on_one_rank(body)


def test_wrap_local_leaves_a_piece_where_it_lives() -> None:
    """fully_shard's offloaded shards are CPU pieces of a CUDA mesh's DTensors (and a checkpoint
    loads into them): the internal wrapper must not move them, unlike ``from_local``."""
    from ringlet.dtensor._api import wrap_local

    def body() -> None:
        x = torch.ones(2, 3)
        dt = wrap_local(x, _meta_mesh(), [Shard(0)], shape=(2, 3), stride=(3, 1))
        assert dt.to_local().data_ptr() == x.data_ptr() and dt.shape == (2, 3)
    _on_one_rank(body)
