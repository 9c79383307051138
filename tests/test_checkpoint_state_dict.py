"""The state-dict API with DDP, fully_shard, tensor-parallel (parallelize_module, and hand-made
DTensor parameters) models on rank threads: clean
FQNs, FQN-keyed optimizer state, cross-strategy and cross-world-size loads (bit-exact), the
FSDP2 example's full-state-dict flow, and a torch DCP-style Stateful app state."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ringlet.distributed.checkpoint as dcp
from ringlet.distributed.checkpoint.state_dict import (
    StateDictOptions,
    _init_optim_state,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from ringlet.distributed.checkpoint.stateful import Stateful
from ringlet.distributed.fsdp import fully_shard
from ringlet.distributed.tensor import DTensor, Shard, distribute_tensor, init_device_mesh
from ringlet.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from ringlet.nn.parallel import DistributedDataParallel as DDP
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, 7)
        self.fc2 = nn.Linear(7, 3)
        self.register_buffer("count", torch.tensor([0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def _net(seed: int) -> Net:
    """A Net with values from its own generator (rank threads share torch's global one)."""
    net = Net()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return net


def _reference() -> tuple[Net, torch.optim.Optimizer]:
    """A model and Adam state after two steps, identical on every caller."""
    net = _net(0)
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    for i in range(2):
        net(torch.full((4, 5), float(i + 1))).sum().backward()
        opt.step()
        opt.zero_grad()
    net.count += 2
    return net, opt


def _build(kind: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    net = _net(1)                           # different values from the reference on purpose
    if kind == "ddp":
        net = DDP(net)
    elif kind == "fsdp":
        fully_shard(net.fc1)
        fully_shard(net)
    # ringlet's tensor parallelism: fc1 column-wise, fc2 row-wise
    elif kind == "tp_api":
        parallelize_module(net, init_device_mesh("cpu", (world,)), {"fc1": ColwiseParallel(),
                                                                     "fc2": RowwiseParallel()})
    # hand-made TP: fc1 column-wise, fc2 row-wise DTensor parameters
    elif kind == "tp":
        mesh = init_device_mesh("cpu", (world,))
        for mod, dim in ((net.fc1, 0), (net.fc2, 1)):
            mod.weight = nn.Parameter(distribute_tensor(mod.weight.detach(), mesh, [Shard(dim)]))
    return net, torch.optim.Adam(net.parameters(), lr=0.01)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _same(kind: str, world: int, path: str) -> bool:
    """Load the reference checkpoint at ``path`` into a ``kind`` model and compare everything."""
    net, opt = _build(kind, world)
    msd, osd = get_state_dict(net, opt)
    assert all(not k.startswith("module.") for k in msd), list(msd)
    assert set(osd["state"]) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(net, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    ref, ref_opt = _reference()
    got = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
    assert set(got) == set(ref.state_dict())
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), (kind, k)
    full = get_optimizer_state_dict(net, opt, options=StateDictOptions(full_state_dict=True))
    ref_state = ref_opt.state_dict()["state"]
    for i, name in enumerate(["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert (torch.equal(_full(full["state"][name][key]),
                                ref_state[i][key])), (kind, name, key)
    assert (full["param_groups"][0]["lr"] == 0.01
            and full["param_groups"][0]["betas"] == (0.9, 0.999))
    return True


def _save_from(rank: int, world: int, kind: str, path: str) -> None:
    net, opt = _build(kind, world)
    ref, ref_opt = _reference()
    set_model_state_dict(net, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    set_optimizer_state_dict(net, opt, _fqn_optim(ref_opt),
                             options=StateDictOptions(full_state_dict=True))
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)


def _fqn_optim(opt: torch.optim.Optimizer) -> dict:
    osd = opt.state_dict()
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    return {"state": {names[i]: s for i, s in osd["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                             for g in osd["param_groups"]]}


def _load_as(rank: int, world: int, kind: str, path: str) -> bool:
    return _same(kind, world, path)


@pytest.mark.parametrize(("src", "n"),
                         [("ddp", 2), ("fsdp", 2), ("tp", 2), ("fsdp", 3), ("tp_api", 2)])
def test_model_and_optimizer_move_between_strategies_and_world_sizes(tmp_path, src: str,
                                                                     n: int) -> None:
    path = str(tmp_path / "ck")
    run_threads(_save_from, n, src, path)
    for dst, m in (("ddp", 2), ("fsdp", 3), ("tp", 2), ("plain", 1), ("fsdp", 2), ("tp_api", 3)):
        assert run_threads(_load_as, m, dst, path) == [True] * m, (src, n, dst, m)


def test_ddp_keys_are_clean_and_replicated_state_is_written_once(tmp_path) -> None:
    def body(rank: int, world: int) -> list[str]:
        net, opt = _build("ddp", world)
        dcp.save(dict(zip(("model", "optim"), get_state_dict(net, opt), strict=True)),
                 checkpoint_id=str(tmp_path / "ck"))
        return sorted(get_model_state_dict(net))
    keys = run_threads(body, 2)[0]
    assert keys == ["count", "fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
    meta = dcp.FileSystemReader(str(tmp_path / "ck")).read_metadata()
    assert all(len(t.chunks) == 1 for t in meta.tensors.values())
    # the replicated tensors are spread over both ranks, each once
    assert len(meta.files) == 2


def _fsdp2_example(rank: int, world: int, path: str) -> bool:
    """The FSDP2 example's checkpoint flow: full state dict on rank 0 only, broadcast back."""
    ref, ref_opt = _reference()
    net, opt = _build("fsdp", world)
    set_model_state_dict(net, ref.state_dict() if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    set_optimizer_state_dict(net, opt, _fqn_optim(ref_opt) if rank == 0 else {},
                             options=StateDictOptions(full_state_dict=True,
                                                      broadcast_from_rank0=True))
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(net, options=opts)
    osd = get_optimizer_state_dict(net, opt, options=opts)
    if rank != 0:
        return msd == {} and osd == {}
    ok = all(torch.equal(msd[k], v) for k, v in ref.state_dict().items())
    ref_state = ref_opt.state_dict()["state"]
    return ok and torch.equal(osd["state"]["fc2.weight"]["exp_avg"], ref_state[2]["exp_avg"])


def test_fsdp2_example_full_state_dict_flow() -> None:
    assert run_threads(_fsdp2_example, 2, "") == [True, True]


class AppState(Stateful):
    """torch's DCP tutorial app state: model + optimizer through get/set_state_dict."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def _dcp_tutorial(rank: int, world: int, path: str) -> list[float]:
    net = _net(0)
    fully_shard(net)
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    x = torch.arange(20.0).view(4, 5) / 10

    def step() -> float:
        loss = net(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())
    losses = [step() for _ in range(2)]
    dcp.save({"app": AppState(net, opt)}, checkpoint_id=path)
    after = [step() for _ in range(2)]
    net2 = _net(5)
    fully_shard(net2)
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.1)
    dcp.load({"app": AppState(net2, opt2)}, checkpoint_id=path)
    net, opt = net2, opt2
    resumed = [step() for _ in range(2)]
    return [*losses, *after, *resumed]


def test_dcp_tutorial_stateful_app_resumes_to_the_same_losses(tmp_path) -> None:
    out = run_threads(_dcp_tutorial, 2, str(tmp_path / "ck"))
    assert out[0][2:4] == out[0][4:6], out[0]


def test_no_process_group_and_unsupported_options(tmp_path) -> None:
    net, opt = _reference()
    msd, osd = get_state_dict(net, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp_path / "ck")
    net2 = _net(7)
    opt2 = torch.optim.Adam(net2.parameters(), lr=0.5)
    state = {"model": get_model_state_dict(net2), "optim": get_optimizer_state_dict(net2, opt2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dcp.load(state, checkpoint_id=tmp_path / "ck")
    set_state_dict(net2, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(),
                                                 net2.state_dict().values(), strict=True))
    assert opt2.param_groups[0]["lr"] == 0.01
    with pytest.raises(ValueError, match="broadcast_from_rank0=True expects full_state_dict=True"):
        StateDictOptions(broadcast_from_rank0=True)
    with pytest.raises(RuntimeError, match=r"missing keys \['count'\]"):
        set_model_state_dict(net2, {k: v for k, v in net.state_dict().items() if k != "count"})


def test_init_optim_state_matches_torchs_private_helper() -> None:
    """pytorch/examples' FSDP2 checkpointer imports ``_init_optim_state`` from this module."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state as torch_init

    states = []
    for init in (_init_optim_state, torch_init):
        net = _net(0)
        opt = torch.optim.AdamW(net.parameters(), lr=0.1, weight_decay=0.5)
        init(opt)
        assert all(torch.equal(p, q) for p, q in zip(net.parameters(), _net(0).parameters()))
        assert all(p.grad is None for p in net.parameters())
        assert opt.param_groups[0]["lr"] == 0.1
        states.append(opt.state_dict()["state"])
    ours, theirs = states
    assert ours.keys() == theirs.keys() == {0, 1, 2, 3}
    assert all(torch.equal(ours[i][k], theirs[i][k]) for i in ours for k in theirs[i])
    # a gradient is present: both leave the optimizer alone (the coming step creates its state)
    net = _net(0)
    net(torch.ones(1, 5)).sum().backward()
    opt = torch.optim.Adam(net.parameters(), lr=0.1)
    _init_optim_state(opt)
    assert not opt.state



def _load_into_meta(rank: int, world: int) -> list:
    """A model built on meta loads a full state dict broadcast from rank 0 into tensors of its
    own, as torch's does (copy_ into meta would be a silent no-op)."""
    full = _net(3).state_dict()
    with torch.device("meta"):
        net = Net()
    set_model_state_dict(net, full if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    rows = [(v.device.type, torch.equal(v, full[k]),
             v.untyped_storage().data_ptr() != full[k].untyped_storage().data_ptr())
            for k, v in net.state_dict().items()]
    return rows + [all(p.requires_grad for p in net.parameters())]


def test_full_state_dict_loads_into_a_meta_model() -> None:
    for out in run_threads(_load_into_meta, 2):
        assert out == [("cpu", True, True)] * 5 + [True], out
