"""Tensor parallelism: styles on an MLP and embeddings, plans, input/output preparation, state
dicts,
and the errors of bad plans (rank threads; 2 ranks vs 1, 3 where uneven splits matter)."""

from __future__ import annotations

import copy
import os

import _tp_workers as workers
import pytest
import torch
import torch.nn.functional as F
from _tp_models import MLP, RMSNorm, init_
from _workers import seeded
from torch import nn

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(90)
PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}


def _mlp_batches(steps: int, d: int = 8) -> list:
    g = torch.Generator().manual_seed(1)
    # inputs that need a gradient, as activations inside a model do (their all-reduce is counted)
    return [(torch.randn(4, 3, d, generator=g).requires_grad_(), torch.randn(4, 3, d, generator=g))
            for _ in range(steps)]


def _mlp(rank: int, n: int, hidden: int, foreach: bool) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    ref = init_(MLP(hidden=hidden))
    model = parallelize_module(copy.deepcopy(ref), mesh, dict(PLAN))
    out = workers.train_pair(model, ref, _mlp_batches(10), F.mse_loss, foreach=foreach)
    out["params"] = [repr(p) for p in model.parameters()]
    return out


@pytest.mark.parametrize(("n", "hidden", "foreach"), [(2, 10, True), (2, 5, False), (3, 10, True)],
                         ids=["even", "uneven", "3-ranks-uneven"])
def test_mlp_ten_adamw_steps_match_one_rank(n: int, hidden: int, foreach: bool) -> None:
    for r in run_threads(_mlp, n, hidden, foreach):
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5)
        assert r["grad_diff"] < 1e-5 and r["param_diff"] < 1e-5
        # row-parallel down: one all-reduce forward; column-parallel up's input: one backward
        assert r["comms"] == ({"all_reduce": 1}, {}, {"all_reduce": 1})
        assert r["params"] == [f"DTensor(f32[{hidden}@tp,8] S(0))",
                               f"DTensor(f32[{hidden}@tp] S(0))",
                               f"DTensor(f32[8,{hidden}@tp] S(1))", "DTensor(f32[8] R)"]



def _embeddings(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    out = {}
    idx = torch.tensor([[0, 6, 3], [6, 2, 1]])
    for style in (ColwiseParallel(output_layouts=Replicate()),
                  RowwiseParallel(input_layouts=Replicate())):
        ref = init_(nn.Embedding(7, 5))
        emb = parallelize_module(copy.deepcopy(ref), mesh, style)
        with CommDebugMode() as comm:
            y = emb(idx)
        (y * torch.arange(5.0)).sum().backward()
        (ref(idx) * torch.arange(5.0)).sum().backward()
        out[type(style).__name__] = (repr(emb.weight), torch.allclose(y, ref(idx)),
                                     comm.get_comm_counts(),
                                     torch.allclose(emb.weight.grad.full_tensor(), ref.weight.grad),
                                     repr(emb.weight.grad))
    return out


def test_embedding_styles() -> None:
    r = run_threads(_embeddings, 2)[0]
    assert r["ColwiseParallel"] == ("DTensor(f32[7,5@tp] S(1))", True, {"all_gather": 1}, True,
                                    "DTensor(f32[7,5@tp] S(1))")
    # the gradient of the row-split table comes out Replicate and is kept in the table's layout
    assert r["RowwiseParallel"] == ("DTensor(f32[7@tp,5] S(0))", True, {"all_reduce": 1}, True,
                                    "DTensor(f32[7@tp,5] S(0))")


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MLP() for _ in range(2))
        self.norm = RMSNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.norm(x)


def _plans(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    out: dict = {}
    wild = parallelize_module(_Stack(), mesh,
                              {"layers.*.up": ColwiseParallel(),
                               "layers.*.down": RowwiseParallel()})
    out["wildcard"] = sorted(n for n, p in wild.named_parameters() if isinstance(p, DTensor))
    nested = parallelize_module(_Stack(), mesh,
                                {"layers": {"1": {"up": ColwiseParallel(),
                                                  "down": RowwiseParallel()}}})
    out["nested"] = sorted(n for n, p in nested.named_parameters() if isinstance(p, DTensor))
    whole = parallelize_module(nn.Linear(4, 6), mesh, ColwiseParallel(output_layouts=Replicate()))
    root = parallelize_module(nn.Linear(4, 6), mesh, {"": RowwiseParallel()})
    out["single"] = (repr(whole.weight), repr(root.weight), tuple(whole(torch.ones(2, 4)).shape))
    stack = _Stack()
    with pytest.raises(ValueError,
                       match=r"'layers\.\*\.gate' -> ColwiseParallel\(.*\) matches no submodule"):
        parallelize_module(stack, mesh, {"layers.*.gate": ColwiseParallel()}, strict_plan=True)
    with pytest.raises(NotImplementedError, match=r"module 'norm' \(RMSNorm\) with "
                                                  r"ColwiseParallel.*expected an nn.Linear or "
                                                  r"nn.Embedding"):
        parallelize_module(stack, mesh, {"norm": ColwiseParallel()})
    with pytest.raises(NotImplementedError,
                       match=r"module 'layers.0' \(MLP\) with RowwiseParallel"):
        parallelize_module(stack, mesh, {"layers.0": RowwiseParallel()})
    with pytest.raises(TypeError, match="expected a ParallelStyle or a dict"):
        parallelize_module(stack, mesh, ["up"])
    return out


def test_plans_wildcards_nesting_and_bad_plans() -> None:
    r = run_threads(_plans, 2)[0]
    per_layer = ["down.bias", "down.weight", "up.bias", "up.weight"]
    assert r["wildcard"] == [f"layers.{i}.{p}" for i in (0, 1) for p in per_layer]
    assert r["nested"] == [f"layers.1.{p}" for p in per_layer]
    assert r["single"] == ("DTensor(f32[6@tp,4] S(0))", "DTensor(f32[6,4@tp] S(1))", (2, 6))


def _bad_mesh(rank: int, n: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match=r"expected a 1-d mesh, got .*mesh\['tp'\]"):
        parallelize_module(MLP(), mesh, dict(PLAN))
    parallelize_module(MLP(), mesh["tp"], dict(PLAN))


def test_two_d_mesh_must_be_sliced() -> None:
    run_threads(_bad_mesh, 4)


class _KwModule(nn.Module):
    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.seen = (x, scale)
        return x * 2, scale + 1


def _prepare(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    out = {}
    mod = parallelize_module(_KwModule(), mesh, PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(),
        input_kwarg_layouts={"scale": Replicate()},
        desired_input_kwarg_layouts={"scale": Shard(0)}))
    with CommDebugMode() as comm:
        y, s = mod(torch.full((2, 3), float(rank)), scale=torch.arange(4.0))
    out["input"] = (repr(mod.seen[0]), repr(mod.seen[1]), y.full_tensor()[:, 0].tolist(),
                    comm.get_comm_counts())
    mod2 = parallelize_module(_KwModule(), mesh, PrepareModuleInputOutput(
        input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), use_local_input=True,
        output_layouts=(Replicate(), None), desired_output_layouts=(Shard(0), None)))
    y, s = mod2(torch.arange(4.0), scale=torch.ones(1))
    out["input_output"] = (type(mod2.seen[0]).__name__, y.tolist(), type(s).__name__)
    mod3 = parallelize_module(_KwModule(), mesh,
                              PrepareModuleOutput(output_layouts=(Shard(0), Shard(0)),
                                                  desired_output_layouts=(Replicate(), Shard(0)),
                                                  use_local_output=False))
    y, s = mod3(torch.ones(2), scale=torch.ones(1))
    out["output"] = (repr(y), repr(s))
    with pytest.raises(ValueError, match="expected 1 positional inputs"):
        parallelize_module(_KwModule(), mesh, PrepareModuleInput(input_layouts=Shard(0),
                                                                  desired_input_layouts=Replicate()))(
            torch.ones(2), torch.ones(2), scale=torch.ones(1))
    with pytest.raises(AssertionError, match="desired_input_layouts should have same length"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),))
    return out


def test_prepare_module_input_output_with_keywords() -> None:
    for rank, r in enumerate(run_threads(_prepare, 2)):
        assert r["input"] == ("DTensor(f32[4,3] R)", "DTensor(f32[4@tp] S(0))",
                              [0.0, 0.0, 2.0, 2.0], {"all_gather": 1})
        assert r["input_output"] == ("Tensor", [[0.0, 2.0], [4.0, 6.0]][rank], "Tensor")
        assert r["output"] == ("DTensor(f32[4] R)", "DTensor(f32[2@tp] S(0))")


def _sequence_parallel(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    ref = init_(nn.Sequential(nn.LayerNorm(6), nn.Dropout(0.0)))
    with torch.no_grad():
        ref[0].bias.add_(0.5)
    model = parallelize_module(copy.deepcopy(ref), mesh,
                               {"0": SequenceParallel(), "1": SequenceParallel()})
    x = torch.randn(2, 5, 6, generator=torch.Generator().manual_seed(4))
    # 5 positions on 2 ranks (3 + 2): uneven pieces need a DTensor input, which carries the global
    # length (a plain tensor is taken as an even piece); as the row-parallel layer before would hand
    # over
    seq = distribute_tensor(x, mesh, [Shard(1)])
    with CommDebugMode() as fwd:
        y = model(seq)
    loss = (y.full_tensor() * torch.arange(6.0)).sum()
    with CommDebugMode() as bwd:
        loss.backward()
    (ref(x) * torch.arange(6.0)).sum().backward()
    return {"out": (repr(y), torch.allclose(y.full_tensor(), ref(x), atol=1e-6)),
            "fwd": fwd.get_comm_counts(),
            "bwd": bwd.get_comm_counts(), "grads": [repr(p.grad) for p in model.parameters()],
            "close": all(torch.allclose(p.grad.full_tensor(), q.grad, atol=1e-5)
                         for p, q in zip(model.parameters(), ref.parameters()))}


def test_sequence_parallel_layernorm_and_dropout() -> None:
    r = run_threads(_sequence_parallel, 2)[0]
    assert r["out"] == ("DTensor(f32[2,5@tp,6] S(1))", True)       # 5 positions on 2 ranks: 3 + 2
    assert r["fwd"] == {}                                           # norms and dropout: local
    # weight and bias gradients, once each
    assert r["bwd"] == {"all_reduce": 2}
    assert r["grads"] == ["DTensor(f32[6] R)"] * 2 and r["close"]


def _state_dicts(rank: int, n: int, tmp: str) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    ref = init_(MLP())
    model = parallelize_module(copy.deepcopy(ref), mesh, dict(PLAN))
    sd = model.state_dict()
    path = os.path.join(tmp, f"tp{rank}.pt")
    torch.save(sd, path)
    fresh = parallelize_module(init_(MLP(), seed=9), mesh, dict(PLAN))
    fresh.load_state_dict(torch.load(path, weights_only=False))
    plain = parallelize_module(init_(MLP(), seed=9), mesh, dict(PLAN))
    plain.load_state_dict(ref.state_dict())            # full tensors copied into the shards
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    return {"keys": sorted(sd), "types": sorted({type(v).__name__ for v in sd.values()}),
            "loaded": torch.allclose(fresh(x), ref(x), atol=1e-6),
            "plain": torch.allclose(plain(x), ref(x), atol=1e-6),
            "full": all(torch.equal(v.full_tensor(), ref.state_dict()[k]) for k, v in sd.items())}


def test_state_dict_round_trips(tmp_path) -> None:
    for r in run_threads(_state_dicts, 2, str(tmp_path)):
        assert r == {"keys": ["down.bias", "down.weight", "up.bias", "up.weight"],
                     "types": ["DTensor"], "loaded": True, "plain": True, "full": True}


def _clip_mixed(rank: int, n: int) -> tuple[str, float]:
    from ringlet.distributed.tensor.experimental import implicit_replication

    mesh = init_device_mesh("cpu", (n,))
    m = seeded(0, lambda: nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 4)))
    parallelize_module(m, mesh, {"1": ColwiseParallel(), "2": RowwiseParallel()})
    m(torch.ones(2, 4)).sum().backward()
    try:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    with implicit_replication():
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9)
    value = total.full_tensor() if hasattr(total, "full_tensor") else total
    return refused, float(value)


def test_clip_grad_norm_over_mixed_plain_and_dtensor_parameters() -> None:
    # plain (replicated) LayerNorm params beside TP DTensors: torch's error outside
    # implicit_replication; inside it, the norm counts each replicated parameter once
    torch.manual_seed(0)
    ref = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 8), nn.Linear(8, 4))
    ref(torch.ones(2, 4)).sum().backward()
    want = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9))
    for refused, total in run_threads(_clip_mixed, 2):
        # foreach kernels (clip_grad_norm_'s default for DTensors too): the plain gradient
        # itself is refused as an element of _foreach_norm's list
        assert ("expected DTensor arguments only" in refused
                and "_foreach_norm" in refused and "torch.Tensor of shape [4]" in refused)
        assert abs(total - want) < 1e-4 * max(1.0, want), (total, want)
