"""End to end: the README's main job, and a torch.distributed script moved over by text
substitution."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TORCH_SCRIPT = textwrap.dedent('''
    import json, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    t = torch.arange(6, dtype=torch.float32) * (rank + 1)
    dist.all_reduce(t)
    out["all_reduce"] = t.tolist()
    m = torch.tensor([rank * 10 + 1, 5 - rank], dtype=torch.int64)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["max"] = m.tolist()
    b = torch.full((2, 3), float(rank))
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b.tolist()
    g = [torch.empty(2) for _ in range(world)]
    dist.all_gather(g, torch.tensor([rank, -rank], dtype=torch.float32))
    out["all_gather"] = [x.tolist() for x in g]
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2.0 * world) + rank)
    out["reduce_scatter"] = rs.tolist()
    a2a = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(a2a, torch.arange(world) + 100 * rank)
    out["all_to_all_single"] = a2a.tolist()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    out["objects"] = objs
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    elif rank == 1:
        r = torch.empty(1)
        dist.recv(r, src=0)
        out["recv"] = r.tolist()
    dist.barrier()
    with open(sys.argv[1] + f".{rank}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
''')


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)


@pytest.mark.timeout(180)
def test_main_job_matches_single_process() -> None:
    out = _run([sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", "2",
                "examples/train_dp.py", "--steps", "12"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "[rank0]: step   0" in out.stdout
    assert "matches the 1-process run" in out.stdout


@pytest.mark.timeout(240)
def test_torch_script_moved_by_text_substitution_gives_torchs_results(tmp_path) -> None:
    torch_script = tmp_path / "torch_version.py"
    torch_script.write_text(TORCH_SCRIPT)
    ringlet_script = tmp_path / "ringlet_version.py"
    ringlet_script.write_text(TORCH_SCRIPT.replace("torch.distributed", "ringlet.distributed"))
    ref = _run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", str(torch_script), str(tmp_path / "torch")], timeout=180)
    assert ref.returncode == 0, ref.stdout + ref.stderr
    got = _run([sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", "2",
                str(ringlet_script), str(tmp_path / "ringlet")])
    assert got.returncode == 0, got.stdout + got.stderr
    for rank in range(2):
        want = json.loads((tmp_path / f"torch.{rank}").read_text())
        have = json.loads((tmp_path / f"ringlet.{rank}").read_text())
        assert have == want, (rank, have, want)


@pytest.mark.timeout(120)
def test_launcher_reports_the_failing_rank_of_a_collective_job(tmp_path) -> None:
    script = tmp_path / "dies.py"
    script.write_text(textwrap.dedent('''
        import os, torch
        import ringlet.distributed as dist
        dist.init_process_group(timeout=__import__("datetime").timedelta(seconds=5))
        for step in range(20):
            if dist.get_rank() == 1 and step == 3:
                raise RuntimeError("boom at step 3")
            dist.all_reduce(torch.ones(4))
    '''))
    out = _run([sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", "2", str(script)])
    assert out.returncode != 0
    text = out.stdout + out.stderr
    assert "boom at step 3" in text and "rank 1" in text


TP_SCRIPT = textwrap.dedent('''
    # As torch's tensor-parallel examples do: no init_process_group, the mesh joins the job.
    import json, sys
    import torch
    from torch import nn
    import ringlet.distributed as dist
    from ringlet.distributed.device_mesh import init_device_mesh
    from ringlet.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                     parallelize_module)

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    with torch.device("meta"):                     # deferred init: no data moves
        lazy = parallelize_module(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)),
                                  mesh, plan)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    model = parallelize_module(__import__("copy").deepcopy(ref), mesh, plan)
    x = torch.arange(12.0).view(3, 4) / 12
    out = {"backend": dist.get_backend(), "lazy": list(lazy[0].weight.to_local().shape),
           "lazy_device": str(lazy[0].weight.device),
           "diff": float((model(x) - ref(x)).abs().max())}
    with open(sys.argv[1] + f".{dist.get_rank()}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
''')


@pytest.mark.timeout(120)
def test_a_tensor_parallel_script_without_init_process_group(tmp_path) -> None:
    for have in _launch_two(tmp_path, TP_SCRIPT):
        assert have["lazy"] == [3, 4] and have["lazy_device"] == "meta", have
        assert have["diff"] < 1e-6 and have["backend"] == "shm", have


FSDP_SCRIPT = textwrap.dedent('''
    # As torch's fully_shard does: no init_process_group, the default mesh joins the job.
    import json, sys
    import torch
    from torch import nn
    import ringlet.distributed as dist
    from ringlet.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = fully_shard(nn.Linear(4, 2))
    model(torch.ones(3, 4)).sum().backward()
    out = {"initialized": dist.is_initialized(), "world": dist.get_world_size(),
           "mesh": model.weight.device_mesh.device_type,
           "grad": list(model.weight.grad.to_local().shape)}
    with open(sys.argv[1] + f".{dist.get_rank()}", "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
''')


@pytest.mark.timeout(120)
def test_a_fully_shard_script_without_init_process_group(tmp_path) -> None:
    for have in _launch_two(tmp_path, FSDP_SCRIPT):
        assert have == {"initialized": True, "world": 2, "mesh": "cpu", "grad": [1, 4]}, have


def _launch_two(tmp_path: Any, text: str) -> list[dict[str, Any]]:
    """Run ``text`` under ``ringlet-run`` on 2 processes; each rank's JSON ``out.<rank>``."""
    script = tmp_path / "script.py"
    script.write_text(text)
    got = _run([sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", "2",
                str(script), str(tmp_path / "out")])
    assert got.returncode == 0, got.stdout + got.stderr
    return [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(2)]
