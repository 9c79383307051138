"""Rank bodies for tests/test_validation.py (module level: real processes import them).

Each ``check_*`` runs on every rank of a world of 2 (threads or processes) and returns
what the test asserts on; ``proc_suite`` runs them all in one process world.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from typing import Any

import torch
from _fuzz_cases import read_only_map

import ringlet.distributed as dist


def outcome(fn: Any) -> str:
    """``ok`` or ``ExceptionType: message``."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def usable(n: int) -> bool:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return float(t) == n * (n + 1) / 2


def check_dtensor(rank: int, n: int) -> dict[str, Any]:
    """issue 10: dist.all_reduce(dtensor) and broadcast used to segfault (data_ptr() is 0)."""
    from ringlet.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = dist.init_device_mesh("cpu", (n,))
    d = distribute_tensor(torch.arange(4.0), mesh, [Shard(0)])
    r = distribute_tensor(torch.arange(4.0), mesh, [Replicate()])
    seq = dist.group.WORLD.seq
    out = {"all_reduce": outcome(lambda: dist.all_reduce(d)),
           "broadcast": outcome(lambda: dist.broadcast(r, src=0)),
           "all_gather_into_tensor": outcome(
               lambda: dist.all_gather_into_tensor(torch.empty(4), d)),
           "send": outcome(lambda: dist.send(d, dst=1 - rank))}
    out["seq_unchanged"] = dist.group.WORLD.seq == seq
    local = d.to_local().clone()
    dist.all_reduce(local)
    out["to_local_works"] = local.tolist()
    out["usable"] = usable(n)
    return out


def check_read_only(rank: int, n: int) -> dict[str, Any]:
    """Writing into read-only memory must raise, never SIGSEGV; reading from it is fine."""
    out: dict[str, Any] = {}
    with warnings.catch_warnings():
        # torch warns that the buffer is not writable
        warnings.simplefilter("ignore", UserWarning)
        frozen = torch.frombuffer(bytes(range(1, 9)), dtype=torch.uint8)
        mm = read_only_map(bytes(range(16)) * 256)
        mapped = torch.frombuffer(mm, dtype=torch.float32)
    out["bytes_all_reduce"] = outcome(lambda: dist.all_reduce(frozen))
    out["mmap_all_reduce"] = outcome(lambda: dist.all_reduce(mapped))
    out["mmap_recv"] = outcome(lambda: dist.recv(mapped, src=1 - rank))
    sent = torch.zeros(8, dtype=torch.uint8)
    dist.all_gather_into_tensor(torch.zeros(n * 8, dtype=torch.uint8), frozen)   # read: allowed
    if rank == 0:
        dist.broadcast(frozen, src=0)                      # the source only reads: allowed
    else:
        dist.broadcast(sent, src=0)
    out["broadcast_from_bytes"] = sent.tolist() if rank else frozen.tolist()
    out["usable"] = usable(n)
    mapped = torch.empty(0)      # the last view of the mapping goes before it is closed
    mm.close()
    return out


def check_freed_storage(rank: int, n: int) -> dict[str, Any]:
    """A storage resized to 0 bytes (as FSDP frees parameters) is refused, before and while
    queued."""
    t = torch.ones(4)
    t.untyped_storage().resize_(0)
    out = {"freed": outcome(lambda: dist.all_reduce(t))}
    # Queue an all_reduce behind a barrier that waits for rank 1, then free its tensor meanwhile:
    # the op must refuse when it finally runs instead of writing into freed memory.  (Rank 1 then
    # waits for rank 0 in vain, on a group of its own, until rank 0 destroys that group: a
    # departure, named at once; the long deadline is never what ends it.)
    g = dist.new_group(timeout=timedelta(seconds=60))
    if rank == 1:
        time.sleep(0.5)
    dist.barrier(group=g, async_op=True)
    u = torch.ones(1 << 12)
    work = dist.all_reduce(u, group=g, async_op=True)
    if rank == 0:
        u.untyped_storage().resize_(0)
    out["queued"] = outcome(work.wait)
    dist.destroy_process_group(g)
    out["usable"] = usable(n)
    return out


def check_barrier(rank: int, n: int) -> dict[str, Any]:
    out = {"device_ids": outcome(lambda: dist.barrier(device_ids="0")),
           "timeout_type": outcome(lambda: dist.barrier(timeout="1s"))}
    dist.barrier(device_ids=[0], timeout=timedelta(seconds=5))
    g = dist.new_group()                 # the late barrier poisons its group, not the world

    def late() -> None:
        t0 = time.monotonic()
        out["late"] = outcome(lambda: dist.barrier(group=g, timeout=timedelta(seconds=0.5)))
        out["elapsed"] = time.monotonic() - t0
    # Rank 1 enters only once rank 0 has given up (the world's barrier orders it, not a sleep):
    # late for certain, so it learns of rank 0's timeout from the abort record.
    if rank == 0:
        late()
        dist.barrier()
    else:
        dist.barrier()
        late()
    dist.destroy_process_group(g)
    out["usable"] = usable(n)
    return out


def check_sort_ranks(rank: int, n: int) -> dict[str, Any]:
    g = dist.new_group(list(reversed(range(n))), sort_ranks=False)
    t = torch.tensor([float(rank)])
    dist.broadcast(t, group=g, group_src=0)            # group rank 0 is the last global rank
    return {"group_rank": dist.get_group_rank(g, rank), "ranks": dist.get_process_group_ranks(g),
            "got": float(t)}


def check_object_lists(rank: int, n: int) -> dict[str, Any]:
    got: list[Any] = [None, None]
    for use_batch in (False, True):
        if rank == 0:
            dist.send_object_list([{"a": use_batch}, torch.arange(3)], dst=1, use_batch=use_batch)
        else:
            dist.recv_object_list(got, src=0, use_batch=use_batch)
    return {"got": repr(got)}


def check_split_group(rank: int, n: int) -> dict[str, Any]:
    g = dist.split_group(split_ranks=[[r] for r in range(n)])
    whole = dist.split_group(split_ranks=[list(range(n))], group_desc="whole")
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g)
    u = torch.tensor([float(rank + 1)])
    dist.all_reduce(u, group=whole)
    only0 = dist.split_group(split_ranks=[[0]])
    bad = outcome(lambda: dist.split_group(split_ranks=[[0, 1], [1]]))
    return {"own": float(t), "whole": float(u), "size": dist.get_world_size(g),
            "none_for_others": only0 is None if rank else only0 is not None, "bad": bad}


def check_coalescing(rank: int, n: int) -> dict[str, Any]:
    pg = dist.group.WORLD
    before = dict(pg.counts())
    a = torch.full((3,), float(rank + 1))
    b = torch.full((2, 2), float(rank + 1)).T          # strided: copied back into the view
    c = torch.full((2,), rank + 1, dtype=torch.int64)
    outs = torch.empty(2 * n)
    rs = torch.empty(2)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        w = dist.all_reduce(b, async_op=True)
        dist.all_reduce(c)
        dist.all_gather_into_tensor(outs, torch.full((2,), float(rank)))
        dist.reduce_scatter_tensor(rs, torch.arange(2.0 * n))
    cm.wait()
    w.wait()
    after = pg.counts()
    with dist._coalescing_manager():
        d = torch.ones(2)
        dist.all_reduce(d)
        e = torch.full((1,), float(rank))
        dist.broadcast(e, src=1)                        # another op: the held all_reduce goes first
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = torch.empty(2 * n)
        dist._all_gather_base(g, torch.full((2,), float(rank)))
        r = torch.empty(1)
        dist._reduce_scatter_base(r, torch.ones(n))
    return {"a": a.tolist(), "b": b.tolist(), "c": c.tolist(), "outs": outs.tolist(),
            "rs": rs.tolist(), "issued": {k: after.get(k, 0) - before.get(k, 0) for k in after},
            "d": d.tolist(), "e": e.tolist(), "base": [g.tolist(), r.tolist()],
            "warned": sorted({str(x.category.__name__) for x in caught})}


def check_profiler(rank: int, n: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    t = torch.ones(6)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
        w = dist.all_gather_into_tensor(torch.empty(6 * n), t, async_op=True)
        w.wait()
    events = [e for e in prof.events()
              if ":" in e.name and not e.name.startswith(("aten::", "profiler:"))]
    reduces = [e for e in events if e.name.endswith(":all_reduce")]
    return {"names": sorted({e.name for e in events}),
            "shapes": [list(map(list, e.input_shapes)) for e in reduces],
            "groups": sorted({e.name for e in prof.events() if e.name.startswith("ringlet:group")})}


def proc_suite(rank: int, n: int) -> dict[str, Any]:
    return {name: fn(rank, n) for name, fn in [
        ("dtensor", check_dtensor), ("read_only", check_read_only), ("freed", check_freed_storage),
        ("barrier", check_barrier),
        ("sort_ranks", check_sort_ranks), ("object_lists", check_object_lists),
        ("split_group", check_split_group), ("coalescing", check_coalescing),
        ("profiler", check_profiler)]}
