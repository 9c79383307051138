"""torch's deprecated checkpoint entry points (issue 26): ``save_state_dict`` and
``load_state_dict`` warn ``FutureWarning`` as torch does and save/load like ``save``/``load``,
in one process (``no_dist``) and on 2 rank threads with a sharded DTensor."""

from __future__ import annotations

import pytest
import torch

import ringlet.distributed.checkpoint as dcp
from ringlet.distributed.checkpoint.state_dict_loader import load_state_dict
from ringlet.distributed.checkpoint.state_dict_saver import save_state_dict
from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import Shard, distribute_tensor
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def test_deprecated_names_warn_and_round_trip(tmp_path) -> None:
    assert dcp.save_state_dict is save_state_dict and dcp.load_state_dict is load_state_dict
    sd = {"w": torch.arange(6.0).view(2, 3), "step": 3}
    with pytest.warns(FutureWarning, match=r"`save_state_dict` is deprecated .*use `save`"):
        meta = save_state_dict(sd, dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    assert isinstance(meta, dcp.Metadata)
    back = {"w": torch.zeros(2, 3), "step": 0}
    with pytest.warns(FutureWarning, match=r"`load_state_dict` is deprecated .*use `load`"):
        load_state_dict(back, dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    assert torch.equal(back["w"], sd["w"]) and back["step"] == 3
    with pytest.warns(FutureWarning), pytest.raises(ValueError, match="coordinator_rank"):
        save_state_dict(sd, dcp.FileSystemWriter(str(tmp_path)), coordinator_rank=-1,
                        no_dist=True)


def _sharded(rank: int, world: int, path: str) -> list[float]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0).view(4, 2)
    save_state_dict({"w": distribute_tensor(full, mesh, [Shard(0)])}, dcp.FileSystemWriter(path))
    into = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(1)])}   # another sharding
    load_state_dict(into, dcp.FileSystemReader(path))
    return into["w"].full_tensor().flatten().tolist()


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_deprecated_names_save_and_reshard_on_two_ranks(tmp_path) -> None:
    for got in run_threads(_sharded, 2, str(tmp_path / "ckpt")):
        assert got == [float(i) for i in range(8)]
