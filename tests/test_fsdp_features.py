"""fully_shard's controls on rank threads: no-sync accumulation, prefetch, HSDP, state dicts, meta
init."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from _fsdp_workers import (
    MLP,
    batch,
    full_params,
    loss_fn,
    make_model,
    make_opt,
    shard_model,
)
from _workers import seeded
from torch import nn

import ringlet.distributed as dist
from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from ringlet.distributed.tensor import DTensor, Shard
from ringlet.parallel.fsdp._param_group import ShardedState
from ringlet.parallel.fsdp._state import TrainingState
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}


# ---------------------------------------------------------------- gradient accumulation


def _accumulate(rank: int, world: int) -> tuple[list[int], float]:
    synced = shard_model(make_model("transformer"))
    unsynced = shard_model(make_model("transformer"))
    pg = dist.group.WORLD
    counts = []
    for micro in range(3):
        x, y = batch("transformer", micro, 2)
        loss_fn("transformer", synced, x, y).backward()
        unsynced.set_requires_gradient_sync(micro == 2)
        pg.reset_counts()
        loss_fn("transformer", unsynced, x, y).backward()
        counts.append(pg.counts().get("reduce_scatter", 0))
        if micro < 2:
            assert all(p.grad is None for p in unsynced.parameters())
    a, b = _grads(synced), _grads(unsynced)
    return counts, max((a[k] - b[k]).abs().max().item() for k in a)


def test_accumulation_without_sync_skips_reduce_scatter_and_matches_synced_accumulation() -> None:
    for counts, diff in run_threads(_accumulate, 2):
        assert counts == [0, 0, 3] and diff < 1e-6


# ---------------------------------------------------------------- residency and prefetch


def _unshard_api(rank: int, world: int) -> tuple:
    model = shard_model(make_model("mlp"))
    layer = model.layers[1]
    handle = layer.unshard(async_op=True)
    assert isinstance(handle, UnshardHandle)
    handle.wait()
    unsharded = (type(layer.weight) is nn.Parameter, tuple(layer.weight.shape))
    layer.reshard()
    resharded = isinstance(layer.weight, DTensor)
    assert layer.unshard() is None and not isinstance(layer.weight, DTensor)
    layer.reshard()
    return unsharded, resharded


def test_unshard_and_reshard_by_hand() -> None:
    for unsharded, resharded in run_threads(_unshard_api, 2):
        assert unsharded == (True, (16, 33)) and resharded


def _prefetch(rank: int, world: int, explicit: bool) -> tuple[list[bool], list[bool], float]:
    model = shard_model(make_model("transformer"))
    ref = copy.deepcopy(model)
    blocks = model.blocks
    if explicit:
        blocks[0].set_modules_to_forward_prefetch([blocks[1]])
        blocks[1].set_modules_to_backward_prefetch([blocks[0]])
    ahead_fwd, ahead_bwd = [], []

    def in_flight(m: FSDPModule) -> bool:
        g = m._get_fsdp_state().group
        return g._pending_unshard is not None or g.sharded_state is ShardedState.UNSHARDED
    blocks[0].register_forward_hook(lambda *a: ahead_fwd.append(in_flight(blocks[1])))
    # runs before block 0's own pre-backward: only a prefetch (from block 1's) can have started it
    blocks[0].register_full_backward_pre_hook(lambda *a: ahead_bwd.append(in_flight(blocks[0])))
    opt = make_opt(model.parameters())
    for step in range(3):
        x, y = batch("transformer", step, 2)
        loss_fn("transformer", model, x, y).backward()
        opt.step()
        opt.zero_grad()
    ref_opt = make_opt(ref.parameters())
    for step in range(3):       # same model without hooks on the blocks' order: same numbers
        x, y = batch("transformer", step, 2)
        loss_fn("transformer", ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    got, want = full_params(model), full_params(ref)
    return ahead_fwd, ahead_bwd, max((got[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("explicit", [False, True])
def test_prefetch_starts_the_next_all_gather_early(explicit: bool) -> None:
    for fwd, bwd, diff in run_threads(_prefetch, 2, explicit):
        # implicit forward prefetch starts once the first iteration recorded the order
        assert fwd == ([True] * 3 if explicit else [False, True, True])
        assert bwd == [True] * 3 and diff == 0


def _reshard_after_backward(rank: int, world: int) -> tuple[int, int]:
    model = shard_model(make_model("mlp"))
    model.set_reshard_after_backward(False)
    pg = dist.group.WORLD
    x, y = batch("mlp", 0, 2)
    loss_fn("mlp", model, x, y).backward()
    live = sum(m._get_fsdp_state().group.unsharded_bytes() for m in model.layers)
    pg.reset_counts()
    loss_fn("mlp", model, x, y)
    return live, pg.counts().get("all_gather", 0)


def test_reshard_after_backward_false_keeps_parameters_for_the_next_forward() -> None:
    full = 4 * sum(p.numel() for p in MLP().parameters())
    assert run_threads(_reshard_after_backward, 2) == [(full, 0)] * 2


def _state_errors(rank: int, world: int) -> None:
    model = shard_model(make_model("mlp"))
    model(torch.ones(1, 8))
    state = model.layers[0]._get_fsdp_state()
    with pytest.raises(AssertionError,
                       match=r"FSDPLinear.*post-forward.*expected training state in .*got idle"):
        state.post_forward(torch.ones(1))
    state.training_state = TrainingState.FORWARD
    with pytest.raises(AssertionError, match=r"FSDPLinear.*pre-backward.*got forward"):
        state.transition(TrainingState.PRE_BACKWARD, "pre-backward")
    group = state.group
    with pytest.raises(AssertionError,
                       match=r"FSDPLinear.*reshard: expected sharded state unsharded, got sharded"):
        group._transition(ShardedState.UNSHARDED, ShardedState.SHARDED, "reshard")


def test_state_transitions_are_checked_and_name_the_module() -> None:
    run_threads(_state_errors, 2)


# ---------------------------------------------------------------- controls


class Generator(MLP):
    def generate(self, x: torch.Tensor) -> tuple[bool, torch.Tensor]:
        w = self.layers[-1].weight          # used directly, not only through forward
        sharded = isinstance(w, DTensor)
        out = self(x).sum()                 # forward inside: its hooks pass through
        return sharded, out if sharded else out + w.sum()


def _forward_method(rank: int, world: int) -> tuple[bool, bool, bool, float]:
    # the root owns every parameter here
    plain = fully_shard(Generator(), reshard_after_forward=True)
    sharded_inside_plain, _ = plain.generate(torch.ones(1, 8))
    model = fully_shard(Generator(), reshard_after_forward=True)
    register_fsdp_forward_method(model, "generate")
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")      # not an FSDPModule: a no-op
    sharded_inside, out = model.generate(torch.ones(1, 8))
    return (sharded_inside_plain, sharded_inside,
            isinstance(model.layers[-1].weight, DTensor), out.item())


def test_registered_forward_method_unshards_the_module() -> None:
    (plain0, inside0, after0, out0), (_, _, _, out1) = run_threads(_forward_method, 2)
    assert plain0 and not inside0 and after0 and out0 == out1


def _controls(rank: int, world: int) -> tuple:
    model = shard_model(make_model("mlp"), ignored_params=None)
    x, y = batch("mlp", 0, 2)
    seen = []
    for layer in model.layers:
        layer.set_all_reduce_hook(lambda out: seen.append(out.numel()))
    loss_fn("mlp", model, x, y).backward()
    averaged = _grads(model)
    model.zero_grad()
    for layer in model.layers:
        layer.set_gradient_divide_factor(1.0)
    loss_fn("mlp", model, x, y).backward()
    summed = _grads(model)
    ratio = max((summed[k] - world * averaged[k]).abs().max().item() for k in averaged)
    with pytest.raises(ValueError, match="positive number"):
        model.layers[0].set_gradient_divide_factor(0)
    model.set_post_optim_event(object())
    model.set_unshard_in_backward(True)
    return len(seen), ratio


def test_divide_factor_and_all_reduce_hook() -> None:
    for hooks, ratio in run_threads(_controls, 2):
        assert hooks == 6 and ratio < 1e-6


def _ignored(rank: int, world: int) -> tuple[bool, bool, float]:
    model = make_model("mlp")
    keep = model.layers[0].bias
    shard_model(model, ignored_params={keep})
    x, y = batch("mlp", 0, 4)
    loss_fn("mlp", model, x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2]).backward()
    return isinstance(keep, DTensor), model.layers[0].bias is keep, keep.grad.sum().item()


def test_ignored_parameters_are_left_alone() -> None:
    (d0, same0, g0), (d1, same1, g1) = run_threads(_ignored, 2)
    assert not d0 and same0 and g0 != g1      # local gradients: not reduced


def _reshard_int(rank: int, world: int) -> None:
    assert (fully_shard(nn.Linear(4, 4),
                        reshard_after_forward=1)._get_fsdp_state().reshard_after_forward is False)
    assert fully_shard(nn.Linear(4, 4),
                       reshard_after_forward=world)._get_fsdp_state().reshard_after_forward is True
    with pytest.raises(ValueError, match="divides the shard world size 4"):
        fully_shard(nn.Linear(4, 4), reshard_after_forward=3)
    # a proper divisor: a 2-rank post-forward group
    m = fully_shard(nn.Linear(4, 4), reshard_after_forward=2)
    assert m._get_fsdp_state().reshard_after_forward == 2
    assert m._get_fsdp_state().group.comm.post_forward_pg.size() == 2


def test_reshard_after_forward_as_a_world_size() -> None:
    run_threads(_reshard_int, 4)


def test_policies_are_frozen_keyword_only_and_validated() -> None:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        mp.param_dtype = torch.float16  # type: ignore[misc]
    with pytest.raises(TypeError):
        MixedPrecisionPolicy(torch.bfloat16)  # type: ignore[misc]
    with pytest.raises(TypeError, match="floating-point"):
        MixedPrecisionPolicy(param_dtype=torch.int8)
    with pytest.raises(TypeError, match="pin_memory"):
        CPUOffloadPolicy(pin_memory="yes")  # type: ignore[arg-type]
    assert isinstance(CPUOffloadPolicy(), OffloadPolicy)


def _offload(rank: int, world: int) -> float:
    model = shard_model(make_model("mlp"), offload_policy=CPUOffloadPolicy(pin_memory=True))
    x, y = batch("mlp", 0, 2)
    return loss_fn("mlp", model, x, y).item()


def test_cpu_offload_policy_is_accepted_as_a_no_op() -> None:
    a, b = run_threads(_offload, 2)
    assert a == b


# ---------------------------------------------------------------- HSDP


def _hsdp(rank: int, world: int) -> tuple[list[float], list[float], float, dict, dict, tuple]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = make_model("transformer")
    ref = copy.deepcopy(model)
    shard_model(model, mesh=mesh)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    shard_pg, rep_pg = mesh.get_group("shard"), mesh.get_group("replicate")
    losses, ref_losses = [], []
    for step in range(4):
        x, y = batch("transformer", step, 8)
        shard_pg.reset_counts()
        rep_pg.reset_counts()
        loss = loss_fn("transformer", model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        loss.backward()
        counts = shard_pg.counts(), rep_pg.counts()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(avg := loss.detach().clone(), op=dist.ReduceOp.AVG)
        losses.append(avg.item())
        ref_loss = loss_fn("transformer", ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    got, want = full_params(model), full_params(ref)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    return losses, ref_losses, diff, counts[0], counts[1], model.blocks[0].fc.weight.placements


def test_hsdp_on_a_2x2_mesh_matches_single_process_training() -> None:
    for losses, ref, diff, shard_counts, rep_counts, placements in run_threads(_hsdp, 4):
        assert losses == pytest.approx(ref, abs=1e-5) and diff < 1e-5
        assert (shard_counts == {"all_gather": 5, "reduce_scatter": 3}
                and rep_counts == {"all_reduce": 3})
        assert placements[1] == Shard(0)


# ---------------------------------------------------------------- state dicts and meta init


def _state_dict(rank: int, world: int) -> tuple[bool, float, float, float, bool]:
    model = shard_model(make_model("transformer", tie=True))
    before = full_params(model)
    sd = model.state_dict()
    all_dtensor = all(isinstance(v, DTensor) and v.placements == (Shard(0),) for v in sd.values())
    saved = {k: v.detach().clone() for k, v in sd.items()}
    full = {k: v.full_tensor() for k, v in sd.items()}
    opt = make_opt(model.parameters())
    x, y = batch("transformer", 0, 2)
    loss_fn("transformer", model, x, y).backward()
    opt.step()

    def gap() -> float:
        now = full_params(model)
        return max((now[k] - before[k]).abs().max().item() for k in before)
    moved = gap()
    model.load_state_dict(saved)
    from_dtensors = gap()
    opt.step()
    model.load_state_dict(full)
    from_full = gap()
    model.load_state_dict(saved, assign=True)
    tied = model.head.weight is model.tok.weight and isinstance(model.head.weight, DTensor)
    assert gap() == 0
    loss_fn("transformer", model, x, y).backward()      # still trains after assign
    return all_dtensor and tied, moved, from_dtensors, from_full, model.tok.weight.grad is not None


def test_state_dict_round_trip_with_dtensors_full_tensors_and_assign() -> None:
    for ok, moved, a, b, trained in run_threads(_state_dict, 2):
        assert ok and moved > 0 and a == 0 and b == 0 and trained


def _meta_resume(rank: int, world: int, how: str) -> tuple[str, float, list[float]]:
    """A model built on meta, sharded, then given its values by assignment (the resume path of
    torch's FSDP2 example): it trains like the same model built with those values."""
    from ringlet.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from ringlet.distributed.tensor import distribute_tensor

    ref = seeded(0, lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)))
    full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    fully_shard(model[0])
    fully_shard(model)
    if how == "assign":
        mesh, pls = model[0].weight.device_mesh, model[0].weight.placements
        sd = {k: nn.Parameter(distribute_tensor(v, mesh, pls)) for k, v in full.items()}
        model.load_state_dict(sd, assign=True)
    else:
        set_model_state_dict(model, full if rank == 0 else {}, options=StateDictOptions(
            full_state_dict=True, broadcast_from_rank0=True))
    x = torch.arange(8.0).view(2, 4) / 8
    got, want = model(x), ref(x)
    got.sum().backward()
    grads = [float(p.grad.full_tensor().abs().sum()) for p in model.parameters()]
    return str(model[0].weight.to_local().device), float((got - want).abs().max()), grads


@pytest.mark.parametrize("how", ["assign", "set_model_state_dict"])
def test_a_model_built_on_meta_takes_assigned_values(how: str) -> None:
    for device, diff, grads in run_threads(_meta_resume, 2, how):
        assert device == "cpu" and diff == 0.0 and all(g > 0 for g in grads), (device, diff)


def _meta_init(rank: int, world: int) -> tuple[bool, float, float]:
    with torch.device("meta"):
        model = make_model("transformer")
    shard_model(model)
    on_meta = all(p.device.type == "meta" for p in model.parameters())
    model.to_empty(device="cpu")
    with torch.no_grad():
        # ranks initialise their own shards: no RNG coordination needed
        torch.manual_seed(rank)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    ref = make_model("transformer")
    ref.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(3):
        x, y = batch("transformer", step, 4)
        loss_fn("transformer", model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).backward()
        loss_fn("transformer", ref, x, y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    got, want = full_params(model), full_params(ref)
    bound = max(p.full_tensor().abs().max().item() for p in model.blocks[0].fc.parameters())
    return on_meta, max((got[k] - want[k]).abs().max().item() for k in want), bound


def test_meta_init_then_to_empty_and_reset_parameters() -> None:
    for on_meta, diff, bound in run_threads(_meta_init, 2):
        assert on_meta and diff < 1e-5 and 0 < bound < 1

