"""fully_shard on rank threads: contracts, parity with one process, collective counts, memory."""

from __future__ import annotations

import copy

import pytest
import torch
from _fsdp_workers import (
    MLP,
    Transformer,
    batch,
    bf16_policy,
    freeze_some,
    full_params,
    loss_fn,
    make_model,
    make_opt,
    shard_model,
    train_pair,
)
from torch import nn

import ringlet.distributed as dist
from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.fsdp import FSDPModule, fully_shard
from ringlet.distributed.tensor import DTensor, Replicate, Shard
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def _live_unsharded(model: nn.Module) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, FSDPModule) and (g := m._get_fsdp_state().group) is not None:
            total += g.unsharded_bytes()
    return total


# ---------------------------------------------------------------- contracts


def _contracts(rank: int, world: int) -> None:
    lin = nn.Linear(4, 33)
    lin.weight.data = torch.arange(132.0).view(33, 4)
    full = lin.weight.detach().clone()
    out = fully_shard(lin)
    assert out is lin and isinstance(lin, FSDPModule) and isinstance(lin, nn.Linear)
    assert type(lin).__name__ == "FSDPLinear"
    other = fully_shard(nn.Linear(2, 2))
    assert type(other) is type(lin)             # one subclass per user class
    w = lin.weight
    assert isinstance(w, nn.Parameter) and isinstance(w, DTensor)
    assert w.placements == (Shard(0),) and w.shape == (33, 4)
    assert w.to_local().shape == ({2: [17, 16], 3: [11, 11, 11]}[world][rank], 4)
    assert torch.equal(w.full_tensor(), full)
    assert all(isinstance(p, DTensor) for p in lin.parameters())
    with pytest.raises(ValueError, match="already applied"):
        fully_shard(lin)


@pytest.mark.parametrize("world", [2, 3])
def test_fully_shard_reclasses_the_module_and_shards_parameters(world: int) -> None:
    run_threads(_contracts, world)


def test_scalars_and_mixed_dtypes_are_refused_clearly() -> None:
    def body(rank: int, world: int) -> None:
        m = nn.Module()
        m.a = nn.Parameter(torch.tensor(1.0))
        with pytest.raises(ValueError, match="scalar"):
            fully_shard(m)
        m2 = nn.Module()
        m2.a, m2.b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float64))
        with pytest.raises(ValueError, match="one dtype"):
            fully_shard(m2)
        with pytest.raises(ValueError, match="non-empty list"):
            fully_shard([])
    run_threads(body, 2)


# ---------------------------------------------------------------- parity


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_ten_steps_match_single_process_training(kind: str) -> None:
    for losses, ref, diff in run_threads(train_pair, 2, kind):
        assert losses == pytest.approx(ref, abs=1e-5)
        assert diff < 1e-5


def test_world_size_one_and_three_match_single_process() -> None:
    for world in (1, 3):
        for losses, ref, diff in run_threads(train_pair, world, "mlp", 4, 3):
            assert losses == pytest.approx(ref, abs=1e-5) and diff < 1e-5


def _bf16_pair(rank: int, world: int, kind: str, steps: int = 4,
               rows: int = 4) -> tuple[list[float], list[float], float, set]:
    """bf16 FSDP vs a reference doing the same math: each rank's slice in bf16, grads averaged in
    fp32."""
    model = make_model(kind)
    ref = copy.deepcopy(model)
    shard_model(model, mp_policy=bf16_policy())
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = batch(kind, step, rows * world)
        loss = loss_fn(kind, model, x[rank * rows:(rank + 1) * rows],
                       y[rank * rows:(rank + 1) * rows])
        loss.backward()
        grad_dtypes = {p.grad.dtype for p in model.parameters()}
        opt.step()
        opt.zero_grad()
        dist.all_reduce(avg := loss.detach().clone(), op=dist.ReduceOp.AVG)
        losses.append(avg.item())
        low = copy.deepcopy(ref).to(torch.bfloat16)
        parts = []
        for r in range(world):
            part = loss_fn(kind, low, x[r * rows:(r + 1) * rows].to(torch.bfloat16) if kind == "mlp"
                           else x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows])
            part.backward()
            parts.append(part.item())
        for p, q in zip(ref.parameters(), low.parameters()):
            p.grad = q.grad.float() / world
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(sum(parts) / world)
    got, want = full_params(model), full_params(ref)
    return losses, ref_losses, max((got[k] - want[k]).abs().max().item() for k in want), grad_dtypes


@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_bf16_mixed_precision_matches_its_reference(kind: str) -> None:
    for losses, ref, diff, grad_dtypes in run_threads(_bf16_pair, 2, kind):
        assert grad_dtypes == {torch.float32}          # grads in the master params' dtype
        assert losses == pytest.approx(ref, abs=2e-3)
        assert diff < 2e-3


def _mp_dtypes(rank: int, world: int) -> tuple:
    model = shard_model(make_model("mlp"), mp_policy=bf16_policy())
    seen: list = []
    model.layers[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
    model.layers[0].register_forward_hook(lambda m, a, o: seen.extend((a[0].dtype, o.dtype)))
    out = model(torch.ones(2, 8))
    return tuple(seen), out.dtype, {p.dtype for p in model.parameters()}


def test_mixed_precision_computes_in_param_dtype_and_keeps_fp32_masters() -> None:
    (w, x, y), out, masters = run_threads(_mp_dtypes, 2)[0]
    assert (w, x, y, out) == (torch.bfloat16,) * 4 and masters == {torch.float32}


# ---------------------------------------------------------------- collectives and memory


def _counts(rank: int, world: int) -> list[dict[str, int]]:
    mesh = init_device_mesh("cpu", (world,))
    pg = mesh.get_group()
    model = shard_model(make_model("transformer"), mesh=mesh)
    opt = make_opt(model.parameters())
    seen = []
    for step in range(3):
        x, y = batch("transformer", step, 2)
        pg.reset_counts()
        loss = loss_fn("transformer", model, x, y)
        fwd = pg.counts()
        loss.backward()
        total = pg.counts()
        opt.step()
        opt.zero_grad()
        seen.append({"fwd_ag": fwd.get("all_gather", 0), "fwd_rs": fwd.get("reduce_scatter", 0),
                     "ag": total.get("all_gather", 0), "rs": total.get("reduce_scatter", 0)})
    return seen


def test_one_all_gather_per_group_in_forward_and_one_reduce_scatter_in_backward() -> None:
    # 3 groups (2 blocks + root); the root keeps its parameters after forward (not re-gathered).
    for per_step in run_threads(_counts, 2):
        assert per_step == [{"fwd_ag": 3, "fwd_rs": 0, "ag": 5, "rs": 3}] * 3


def _storage(rank: int, world: int, raf: bool | None) -> tuple[int, int, int, int]:
    model = shard_model(make_model("transformer"), reshard_after_forward=raf)
    full = sum(p.numel() * 4 for p in model.parameters())
    x, y = batch("transformer", 0, 2)
    loss = loss_fn("transformer", model, x, y)
    after_forward = _live_unsharded(model)
    loss.backward()
    params = list(model.parameters())
    return (full, after_forward, _live_unsharded(model),
            sum(not isinstance(p, DTensor) for p in params))


def test_reshard_after_forward_frees_unsharded_storage() -> None:
    root_bytes = sum(p.numel() * 4 for n, p in Transformer().named_parameters()
                     if not n.startswith("blocks"))
    for full, fwd, bwd, n_plain in run_threads(_storage, 2, True):
        assert (fwd, bwd) == (0, 0) and n_plain == 0
    for full, fwd, bwd, _ in run_threads(_storage, 2, False):
        assert fwd == full and bwd == 0
    # default: only the root stays unsharded
    for full, fwd, bwd, _ in run_threads(_storage, 2, None):
        assert fwd == root_bytes and bwd == 0


def _logical_bytes(rank: int, world: int) -> tuple[int, int]:
    model = shard_model(make_model("transformer", dim=32, vocab=64))
    ddp = 4 * sum(p.numel() * p.element_size()
                  for p in make_model("transformer", dim=32, vocab=64).parameters())
    opt = make_opt(model.parameters())
    x, y = batch("transformer", 0, 2)
    loss_fn("transformer", model, x, y.clamp(max=31)).backward()
    opt.step()
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        local = t.to_local() if isinstance(t, DTensor) else t
        st = local.untyped_storage()
        if st.data_ptr() not in seen and local.dim() > 0:
            seen.add(st.data_ptr())
            total += st.nbytes()
    for p in model.parameters():
        add(p)
        add(p.grad)
        for v in opt.state[p].values():
            add(v)
    return total, ddp


def test_params_grads_and_optimizer_state_per_rank_shrink_with_ranks() -> None:
    two = run_threads(_logical_bytes, 2)
    four = run_threads(_logical_bytes, 4)
    ddp = two[0][1]
    assert max(b for b, _ in two) <= 0.55 * ddp
    assert max(b for b, _ in four) <= 0.30 * ddp


# ---------------------------------------------------------------- shapes, ties, frozen


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.big = nn.Parameter(torch.randn(33, 4, generator=g))
        self.one = nn.Parameter(torch.randn(1, generator=g))
        self.empty = nn.Parameter(torch.randn(0, 3, generator=g))
        self.vec = nn.Parameter(torch.randn(5, generator=g))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.big.T).sum(-1) * self.one + self.vec.sum() + self.empty.sum()


def _odd(rank: int, world: int) -> float:
    model = Odd()
    ref = copy.deepcopy(model)
    fully_shard(model)
    opt, ref_opt = (torch.optim.SGD(model.parameters(), lr=0.01),
                    torch.optim.SGD(ref.parameters(), lr=0.01))
    for step in range(3):
        x = torch.arange(8.0 * world).view(2 * world, 4) / 64 - step / 8
        model(x[2 * rank:2 * rank + 2]).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    got, want = full_params(model), full_params(ref)
    return max((got[k] - want[k]).abs().max().item() for k in want if want[k].numel())


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_single_element_and_empty_parameters(world: int) -> None:
    assert max(run_threads(_odd, world)) < 1e-4


def _tied(rank: int, world: int) -> tuple[bool, int, list[float], list[float], float]:
    losses, ref, diff = train_pair(rank, world, "transformer", 4, model_kw={"tie": True})
    model = shard_model(make_model("transformer", tie=True))
    tied = model.head.weight is model.tok.weight
    return tied, len(list(model.parameters())), losses, ref, diff


def test_tied_parameters_stay_tied_and_are_sharded_once() -> None:
    n_untied = len(list(Transformer().parameters()))
    for tied, n, losses, ref, diff in run_threads(_tied, 2):
        assert tied and n == n_untied - 1
        assert losses == pytest.approx(ref, abs=1e-5) and diff < 1e-5


def _frozen(rank: int, world: int) -> tuple[list[float], list[float], float, bool, dict[str, int]]:
    losses, ref, diff = train_pair(rank, world, "transformer", 4, prepare=freeze_some)
    model = make_model("transformer")
    freeze_some(model)
    shard_model(model)
    pg = dist.group.WORLD
    pg.reset_counts()
    x, y = batch("transformer", 0, 2)
    loss_fn("transformer", model, x, y).backward()
    no_grad = model.blocks[0].fc.weight.grad is None and model.blocks[0].ln1.bias.grad is None
    return losses, ref, diff, no_grad, pg.counts()


def test_frozen_parameters_are_gathered_but_not_reduced() -> None:
    for losses, ref, diff, no_grad, counts in run_threads(_frozen, 2):
        assert no_grad and counts.get("reduce_scatter") == 3
        assert losses == pytest.approx(ref, abs=1e-5) and diff < 1e-5


def test_hsdp_placements_replicate_then_shard() -> None:
    def body(rank: int, world: int) -> tuple:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        m = fully_shard(MLP(), mesh=mesh)
        return m.layers[0].weight.placements, m.layers[0].weight.to_local().shape
    for rank, (placements, shape) in enumerate(run_threads(body, 4)):
        assert placements == (Replicate(), Shard(0)) and shape == ([17, 16][rank % 2], 8)
