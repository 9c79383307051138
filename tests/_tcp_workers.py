"""Rank bodies for the tcp / auto tests: run_world bodies (loopback) and a script for simulated
hosts.

As a script (one process per rank, started with ``ip netns exec`` by tests/test_netns*.py)::

    python tests/_tcp_workers.py MODE RANK WORLD OUTDIR MASTER_ADDR BACKEND TIMEOUT

Rank 0 hosts the TCPStore on MASTER_ADDR (port 0, published through OUTDIR/port); every rank
writes what it saw to OUTDIR/rank<r>.json.  Modes: ``cases`` (every collective against a local
reference, and hierarchical vs flat bit-equality), ``cut`` (all_reduce until the link is cut;
OUTDIR/looping<r> says the loop runs), ``both`` (cases, then cut: one start-up for both).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ringlet.distributed as dist

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "PREMUL_SUM"]


def _op(name: str) -> Any:
    return (dist._make_nccl_premul_sum(0.37) if name == "PREMUL_SUM"
            else getattr(dist.ReduceOp, name))


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(bytes(t.contiguous().view(torch.uint8).numpy())).hexdigest()[:16]


def _data(rank: int, case: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case + rank)
    return (torch.randn(numel, generator=g) * 3).to(dtype)


def differential(rank: int, n: int, sizes: tuple[int, ...] = (7, 20_000, 300_001),
                 group: Any = None) -> dict[str, str]:
    """Random (non-integer) floats through the reducing collectives; digests of every result.

    Run under two transports, the digests must be equal: floating-point results depend on the
    reduction order, so equal digests mean the same order (see [Note: tcp reduction order]).
    """
    out: dict[str, str] = {}
    case = 0
    for numel in sizes:
        for dtype in FLOATS:
            for op in OPS:
                case += 1
                if op == "PRODUCT" and numel > 1000:
                    continue   # overflows to inf either way: says nothing about order
                t = _data(rank, case, numel, dtype)
                dist.all_reduce(t, op=_op(op), group=group)
                out[f"all_reduce {numel} {dtype} {op}"] = _digest(t)
                inp = _data(rank, case + 5000, numel * n, dtype)
                rs = torch.empty(numel, dtype=dtype)
                dist.reduce_scatter_tensor(rs, inp, op=_op(op), group=group)
                out[f"reduce_scatter {numel} {dtype} {op}"] = _digest(rs)
                r = _data(rank, case + 9000, numel, dtype)
                dst = dist.get_global_rank(group, n - 1) if group is not None else n - 1
                dist.reduce(r, dst=dst, op=_op(op), group=group)
                if rank == dst:
                    out[f"reduce {numel} {dtype} {op}"] = _digest(r)
    works = [dist.all_reduce(torch.full((1000,), float(rank + i)), async_op=True, group=group)
             for i in range(8)]
    for w in works:
        w.wait()
    return out


def hier_vs_flat(rank: int, n: int) -> list[str]:
    """Default group (hierarchical) against a flat tcp group on the same random data."""
    flat = dist.new_group(backend="tcp")
    mine = differential(rank, n, (7, 70_001), None)
    theirs = differential(rank, n, (7, 70_001), flat)
    bad = [k for k in mine if mine[k] != theirs.get(k)]
    ag_in = torch.arange(70_000, dtype=torch.float32) + rank * 1e5
    a, b = torch.empty(n * 70_000), torch.empty(n * 70_000)
    dist.all_gather_into_tensor(a, ag_in)
    dist.all_gather_into_tensor(b, ag_in, group=flat)
    if not torch.equal(a, b):
        bad.append("all_gather_into_tensor")
    return bad


def _socket_fds() -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                count += 1
        except OSError:
            pass
    return count


def shared_connection(rank: int, n: int) -> dict[str, Any]:
    """One connection per pair carries collectives and point-to-point messages in both orders:
    a message queued behind an operation's frames, frames queued behind a message nobody has
    received yet, a receive from any rank, and concurrent big exchanges on two threads (8 MiB:
    beyond the socket buffers, so flow control holds the senders)."""
    out: dict[str, Any] = {}
    before = _socket_fds()
    g = dist.new_group(list(range(n)), backend="tcp")
    out["sockets_added"] = _socket_fds() - before
    big = 2 * 1024 * 1024                     # float32 elements: 8 MiB
    peer = 1 - rank if rank < 2 else None
    # (a) rank 0's all_reduce frames reach rank 1 before its message; rank 1 receives the message
    # first, and only then joins the all_reduce
    t = torch.full((big,), float(rank + 1))
    msg = torch.full((1000,), 7.0)
    if rank == 0:
        work = dist.all_reduce(t, group=g, async_op=True)
        dist.send(msg, 1, group=g)
        work.wait()
    elif rank == 1:
        got = torch.empty(1000)
        time.sleep(0.3)                          # the frames are there before the receive
        dist.recv(got, 0, group=g)
        out["a_msg"] = bool(torch.equal(got, msg))
        dist.all_reduce(t, group=g)
    else:
        dist.all_reduce(t, group=g)
    out["a_sum"] = bool(torch.equal(t, torch.full((big,), float(n * (n + 1) // 2))))
    # (b) a big message goes first; the receiver runs an all_reduce before receiving it
    payload = torch.arange(big, dtype=torch.float32)
    u = torch.full((big,), 1.0)
    if rank == 0:
        w = dist.isend(payload, 1, group=g)
        dist.all_reduce(u, group=g)
        w.wait()
    elif rank == 1:
        dist.all_reduce(u, group=g)
        got = torch.empty(big)
        dist.recv(got, 0, group=g)
        out["b_msg"] = bool(torch.equal(got, payload))
    else:
        dist.all_reduce(u, group=g)
    out["b_sum"] = bool(torch.equal(u, torch.full((big,), float(n))))
    # (c) a receive from any rank while frames of the next all_reduce are already coming
    v = torch.full((big,), 2.0)
    if rank == 0:
        got = torch.empty(10)
        src = dist.recv(got, None, group=g)
        out["c_src"] = (src, bool(torch.equal(got, torch.full((10,), 3.0))))
        dist.all_reduce(v, group=g)
    else:
        if rank == n - 1:
            dist.send(torch.full((10,), 3.0), 0, group=g)
        dist.all_reduce(v, group=g)
    out["c_sum"] = bool(torch.equal(v, torch.full((big,), 2.0 * n)))
    # (d) big exchanges both ways on p2p threads while the main thread runs all_reduces
    if peer is not None:
        mine = torch.full((big,), float(rank))
        theirs = torch.empty(big)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer, g),
                                        dist.P2POp(dist.irecv, theirs, peer, g)])
    sums, small_ok = [], True
    for i in range(3):
        x = torch.full((300_000,), float(i + rank))
        dist.all_reduce(x, group=g)
        sums.append(float(x[0]))
        for _ in range(20):     # small, in place: what is sent must be the input, not the sum
            y = torch.full((1000,), float(rank + 1))
            dist.all_reduce(y, group=g)
            small_ok = small_ok and bool(torch.equal(y,
                                                     torch.full((1000,), float(n * (n + 1) // 2))))
    out["small_ok"] = small_ok
    if peer is not None:
        for w in works:
            w.wait()
        out["d_msg"] = bool(torch.equal(theirs, torch.full((big,), float(peer))))
    out["d_sums"] = sums == [float(n * i + n * (n - 1) // 2) for i in range(3)]
    dist.destroy_process_group(g)
    return out


def token_mismatch(rank: int, n: int) -> tuple[str, str]:
    """Rank 1 presents another run token to a new tcp group: refused, named, on both sides."""
    os.environ["RINGLET_STORE_TOKEN"] = "right-token" if rank != 1 else "wrong-token"
    try:
        dist.new_group(backend="tcp", timeout=timedelta(seconds=2))
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        os.environ.pop("RINGLET_STORE_TOKEN", None)
    return "none", ""


def backend_name(rank: int, n: int) -> str:
    return dist.get_backend()


def p2p_mismatch(rank: int, n: int) -> tuple[str, str]:
    try:
        if rank == 0:
            dist.send(torch.ones(4), dst=1, tag=7)
            dist.barrier()
        else:
            dist.recv(torch.empty(3), src=0, tag=7)
    except Exception as e:
        return type(e).__name__, str(e)
    return "none", ""


def abort_from_thread(rank: int, n: int) -> tuple[str, str, float]:
    """Rank 0 aborts its group from another thread while its peer waits in a collective."""
    import threading

    pg = dist.group.WORLD
    t0 = time.monotonic()
    try:
        if rank == 0:
            threading.Timer(0.3, lambda: pg.abort("stopped by the test")).start()
            dist.broadcast(torch.ones(4), src=1)    # rank 1 sends only at 1 s: the abort ends this
            time.sleep(1.0)
        else:
            time.sleep(1.0)
            dist.broadcast(torch.ones(4), src=1)    # the root only sends: this completes
            dist.all_reduce(torch.ones(4))          # rank 0's ABORT frame is what arrives
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "none", "", time.monotonic() - t0


def destroy_with_pending_irecv(rank: int, n: int) -> tuple[str, str, float, bool]:
    """Rank 0 destroys a tcp group while its irecv still waits: the receive ends with an error
    soon after, and its thread is gone (nothing waits until the deadline)."""
    import threading

    g = dist.new_group(list(range(n)), backend="tcp", timeout=timedelta(seconds=60))
    dist.barrier()
    if rank != 0:
        dist.barrier()
        return "", "", 0.0, True
    w = dist.irecv(torch.empty(4), 1, group=g)
    time.sleep(0.2)
    t0 = time.monotonic()
    dist.destroy_process_group(g)
    try:
        w.wait()
        got = ("none", "")
    except Exception as e:
        got = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    time.sleep(0.2)
    alive = [t.name for t in threading.enumerate() if g.group_desc in t.name]
    dist.barrier()
    return got[0], got[1], took, not alive


def recv_from_a_peer_that_dies(rank: int, n: int) -> tuple[str, str, float]:
    """Rank 0 waits in recv (with nothing else going on) while rank 1 is SIGKILLed."""
    import signal

    dist.barrier()
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(8), 1)
        got = ("none", "")
    except Exception as e:
        got = (type(e).__name__, str(e))
    return got[0], got[1], time.monotonic() - t0


def any_source_after_peers_left(rank: int, n: int) -> tuple[str, str, float]:
    """Rank 0 receives from any rank after every other rank destroyed the group: an error soon,
    not at the deadline."""
    g = dist.new_group(list(range(n)), backend="tcp", timeout=timedelta(seconds=60))
    dist.barrier()
    if rank != 0:
        dist.destroy_process_group(g)
        dist.barrier()
        return "", "", 0.0
    time.sleep(0.3)
    t0 = time.monotonic()
    try:
        dist.recv(torch.empty(2), None, group=g)
        got = ("none", "")
    except Exception as e:
        got = (type(e).__name__, str(e))
    took = time.monotonic() - t0
    dist.destroy_process_group(g)
    dist.barrier()
    return got[0], got[1], took


def scenarios(rank: int, n: int, T: float) -> dict[str, tuple[str, str, float]]:
    """Faults that poison only their own tcp group, one group each; the world group stays usable."""
    names = ["op", "shape", "dtype", "p2p", "skip"]
    groups = {name: dist.new_group(backend="tcp", timeout=timedelta(seconds=T)) for name in names}
    calls = {
        "op": lambda g: dist.all_reduce(torch.ones(4), group=g) if rank == 0
        else dist.broadcast(torch.ones(3), src=0, group=g),
        "shape": lambda g: dist.all_reduce(torch.ones(4 if rank == 0 else 3), group=g),
        "dtype": lambda g: dist.all_reduce(
            torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64), group=g),
        "p2p": lambda g: (dist.send(torch.ones(4), dst=1, tag=7, group=g), dist.barrier(group=g))
        if rank == 0 else dist.recv(torch.empty(3), src=0, tag=7, group=g),
        "skip": lambda g: dist.all_reduce(torch.ones(4), group=g) if rank == 0
        else time.sleep(T + 1.0),
    }
    out = {}
    for name in names:
        dist.barrier()
        t0 = time.monotonic()
        try:
            calls[name](groups[name])
            out[name] = ("none", "", time.monotonic() - t0)
        except Exception as e:
            out[name] = (type(e).__name__, str(e), time.monotonic() - t0)
    dist.barrier()
    t = torch.ones(3)
    dist.all_reduce(t)            # the world group is untouched by its subgroups' failures
    out["world"] = ("ok" if t.tolist() == [float(n)] * 3 else "bad", "", 0.0)
    out["token"] = (*token_mismatch(rank, n), 0.0)
    return out


def engine_cases(rank: int, n: int) -> dict[str, Any]:
    """Collectives through the torch-engine adapter (gloo), checked against local references."""
    from _cases import make, ref_reduce

    bad: list[str] = []

    def same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            bad.append(f"{what}: got {got.flatten()[:6].tolist()}, want "
                       f"{want.flatten()[:6].tolist()}")

    for case, (dtype, op) in enumerate([(torch.float32, "SUM"), (torch.int64, "MAX"),
                                        (torch.float64, "AVG"),
                                        (torch.float32, "PREMUL_SUM"), (torch.int32, "BXOR")]):
        ins = [make(r, case, (6,), dtype) for r in range(n)]
        t = ins[rank].clone()
        dist.all_reduce(t, op=_op(op) if op != "PREMUL_SUM" else dist._make_nccl_premul_sum(0.5))
        same(f"all_reduce {dtype} {op}", t, ref_reduce(ins, op))
        r = ins[rank].clone()
        dist.reduce(r, dst=n - 1,
                    op=_op(op) if op != "PREMUL_SUM" else dist._make_nccl_premul_sum(0.5))
        same(f"reduce {op}", r, ref_reduce(ins, op) if rank == n - 1 else ins[rank])
        big = [torch.cat([make(q, case + b, (3,), dtype) for b in range(n)]) for q in range(n)]
        rs = torch.empty(3, dtype=dtype)
        dist.reduce_scatter_tensor(rs, big[rank].clone(), op=_op(op) if op != "PREMUL_SUM"
                                   else dist._make_nccl_premul_sum(0.5))
        same(f"reduce_scatter {op}", rs,
             ref_reduce([big[q][rank * 3:rank * 3 + 3] for q in range(n)], op))
    b = torch.full((5,), float(rank))
    dist.broadcast(b, src=1)
    same("broadcast", b, torch.full((5,), 1.0))
    out = torch.empty(n * 4)
    dist.all_gather_into_tensor(out, torch.full((4,), float(rank)))
    same("all_gather_into_tensor", out, torch.arange(n, dtype=torch.float32).repeat_interleave(4))
    gl = [torch.empty(2) for _ in range(n)] if rank == 0 else None
    dist.gather(torch.full((2,), float(rank)), gl, dst=0)
    if gl is not None:
        same("gather", torch.stack(gl), torch.arange(n, dtype=torch.float32)[:, None].expand(n, 2))
    sc = torch.empty(2)
    dist.scatter(sc,
                 [torch.full((2,), 10.0 + q) for q in range(n)] if rank == n - 1
                 else None, src=n - 1)
    same("scatter", sc, torch.full((2,), 10.0 + rank))
    a2a_in = torch.cat([torch.full((rank + j + 1,), float(100 * rank + j)) for j in range(n)])
    a2a_out = torch.empty(sum(q + rank + 1 for q in range(n)))
    dist.all_to_all_single(a2a_out, a2a_in, [q + rank + 1 for q in range(n)],
                           [rank + j + 1 for j in range(n)])
    same("all_to_all_single", a2a_out, torch.cat([torch.full((q + rank + 1,), float(100 * q + rank))
                                                  for q in range(n)]))
    if rank == 0:
        dist.send(torch.tensor([42.0]), dst=1)
    elif rank == 1:
        got = torch.empty(1)
        src = dist.recv(got)
        same("recv any source", got, torch.tensor([42.0]))
        if src != 0:
            bad.append(f"recv returned src {src}")
    objs: list[Any] = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    if objs != [{"rank": q} for q in range(n)]:
        bad.append(f"all_gather_object: {objs}")
    works = [dist.all_reduce(torch.ones(3), async_op=True) for _ in range(4)]
    for w in works:
        w.wait()
    dist.barrier()
    return {"backend": dist.get_backend(), "bad": bad}


def engine_timeout(rank: int, n: int) -> tuple[str, str]:
    """Rank 1 skips an all_reduce: torch's own timeout becomes ringlet's CollectiveTimeoutError."""
    try:
        if rank == 0:
            dist.all_reduce(torch.ones(4))
        else:
            time.sleep(2.5)
    except Exception as e:
        return type(e).__name__, str(e)
    return "none", ""


def nccl_one_gpu(rank: int, n: int, spec: str) -> str:
    """The adapter drives NCCL on CUDA tensors (and gloo on CPU ones with both engines)."""
    from ringlet.store import HashStore
    from ringlet.transport.base import OpContext
    from ringlet.transport.reduce import RedOpType
    from ringlet.transport.torch_engine import TorchEngineTransport

    tr = TorchEngineTransport.create(HashStore(), 0, 1, 60.0, "g", spec)
    try:
        def ctx(op: str, t: torch.Tensor, redop: int = -1) -> OpContext:
            return OpContext(op, 1, 0, 1, "g", 60.0, t.dtype, t.numel(), -1, redop)
        x = torch.arange(8, dtype=torch.float32, device="cuda")
        tr.all_reduce(x, RedOpType.SUM, None, ctx("all_reduce", x, 0))
        tr.broadcast(x, 0, ctx("broadcast", x))
        out = torch.empty(8, device="cuda")
        tr.all_gather(x, out, ctx("all_gather", x))
        assert torch.equal(out.cpu(), torch.arange(8, dtype=torch.float32))
        y = torch.ones(4, device="cuda")
        tr.all_reduce(y, RedOpType.AVG, None, ctx("all_reduce", y, 1))
        assert y.cpu().tolist() == [1.0] * 4
        c = torch.ones(3)
        if "gloo" in spec:
            tr.all_reduce(c, RedOpType.SUM, None, ctx("all_reduce", c, 0))
            assert c.tolist() == [1.0] * 3
        else:
            try:
                tr.all_reduce(c, RedOpType.SUM, None, ctx("all_reduce", c, 0))
            except ValueError as e:
                assert "serves" in str(e), e
            else:
                raise AssertionError("a CPU tensor on an NCCL-only group must be refused")
    finally:
        tr.close()
    return "ok"


def per_device_cpu(rank: int, n: int) -> dict[str, Any]:
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    return {"backend": dist.get_backend(), "transport": dist.group.WORLD.transport_name,
            "sum": float(t[0]),
            "built": sorted(dist.group.WORLD.transport._built),   # the NCCL side waits for CUDA
            "devices": list(dist.group.WORLD.transport.devices)}


def per_device_gpu(rank: int, n: int) -> str:
    """A CPU and a CUDA collective on one ``cpu:shm,cuda:nccl`` group (world of one)."""
    c = torch.ones(3)
    dist.all_reduce(c)
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    dist.all_reduce(x)
    out = torch.empty(8, device="cuda")
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out.cpu(), torch.arange(8, dtype=torch.float32)) and c.tolist() == [1.0] * 3
    assert dist.get_backend() == "cpu:shm,cuda:nccl"
    assert dist.group.WORLD.transport_name == "shm,cuda:torch:nccl"
    return "ok"


def hier_fake_hosts(rank: int, n: int, layouts: list[list[str]]) -> list[str]:
    """The hierarchical transport on loopback with made-up host keys (no namespaces needed):
    all_reduce, reduce_scatter, all_gather and broadcast equal the flat tcp path and a host-major
    reference; point-to-point takes shared memory between host-mates."""
    from ringlet.c10d.world import current_world
    from ringlet.store import PrefixStore
    from ringlet.transport.base import OpContext
    from ringlet.transport.hierarchical import HierarchicalTransport
    from ringlet.transport.reduce import RedOpType, reduction

    bad: list[str] = []
    seq = [0]

    def ctx(op: str, t: torch.Tensor, redop: int = -1, root: int = -1) -> OpContext:
        seq[0] += 1
        return OpContext(op, seq[0], rank, n, "fake", 20.0, t.dtype, t.numel(), root, redop)

    w = current_world()
    for li, keys in enumerate(layouts):
        tr = HierarchicalTransport.create(PrefixStore(f"fake{li}", w.store), rank, keys,
                                          20.0, "fake")
        groups: dict[str, list[int]] = {}
        for r, k in enumerate(keys):
            groups.setdefault(k, []).append(r)
        try:
            for case, (numel, dtype, op) in enumerate(
                    [(7, torch.float32, RedOpType.SUM), (70_001, torch.float32, RedOpType.SUM),
                     (70_001, torch.bfloat16, RedOpType.AVG),
                     (300_000, torch.float64, RedOpType.PREMUL_SUM),
                     (70_001, torch.float32, RedOpType.MAX),
                     (70_001, torch.int64, RedOpType.PRODUCT),
                     (300_000, torch.float32, RedOpType.SUM),
                     (1_200_002, torch.float32, RedOpType.MIN)]):
                xs = [_data(r, case, numel, dtype) if dtype.is_floating_point
                      else torch.randint(-3, 4, (numel,),
                                         generator=torch.Generator().manual_seed(r))
                      for r in range(n)]
                factor = 0.37 if op == RedOpType.PREMUL_SUM else None
                parts = [x * factor for x in xs] if factor else xs
                want = torch.empty_like(xs[0])
                reduction(op, None, dtype, n).fold_(want, parts, list(groups.values()))
                for pipelined in (True, False):     # segments overlapping, or one after another
                    tr.pipelined = pipelined
                    t, f = xs[rank].clone(), xs[rank].clone()
                    tr.all_reduce(t, op, factor, ctx("all_reduce", t, int(op)))
                    tr.net.all_reduce(f, op, factor, ctx("all_reduce", f, int(op)))
                    if not (torch.equal(t, want) and torch.equal(f, want)):
                        bad.append(f"{keys} all_reduce {numel} {dtype} {op.name} "
                                   f"pipelined={pipelined}")
            for case, (N, dtype, op) in enumerate(
                    [(3, torch.float32, RedOpType.SUM), (50_000, torch.float32, RedOpType.SUM),
                     (30_001, torch.bfloat16, RedOpType.AVG),
                     (40_000, torch.float64, RedOpType.PREMUL_SUM),
                     (20_000, torch.int64, RedOpType.MAX)]):
                xs = [_data(r, 50 + case, n * N, dtype) if dtype.is_floating_point
                      else torch.randint(-9, 9, (n * N,),
                                         generator=torch.Generator().manual_seed(r))
                      for r in range(n)]
                factor = 0.37 if op == RedOpType.PREMUL_SUM else None
                parts = [(x * factor if factor else x)[rank * N:(rank + 1) * N] for x in xs]
                want = torch.empty(N, dtype=dtype)
                reduction(op, None, dtype, n).fold_(want, parts, list(groups.values()))
                t, f = torch.empty(N, dtype=dtype), torch.empty(N, dtype=dtype)
                tr.reduce_scatter(xs[rank].clone(), t, op, factor,
                                  ctx("reduce_scatter", t, int(op)))
                tr.net.reduce_scatter(xs[rank].clone(), f, op, factor,
                                      ctx("reduce_scatter", f, int(op)))
                if not (torch.equal(t, want) and torch.equal(f, want)):
                    bad.append(f"{keys} reduce_scatter {N} {dtype} {op.name}")
            inp = torch.arange(70_001, dtype=torch.float32) + 1e6 * rank
            out = torch.empty(n * 70_001)
            tr.all_gather(inp, out, ctx("all_gather", inp))
            if not torch.equal(out, torch.cat([torch.arange(70_001, dtype=torch.float32) + 1e6 * r
                                               for r in range(n)])):
                bad.append(f"{keys} all_gather")
            b = torch.full((300_000,), float(rank))
            tr.broadcast(b, n - 1, ctx("broadcast", b, root=n - 1))
            if not torch.equal(b, torch.full((300_000,), float(n - 1))):
                bad.append(f"{keys} broadcast")
            bad += _hier_p2p(tr, rank, n, keys,      # p2p counts differ by rank: no sequence number
                             lambda op, t: OpContext(op, 0, rank, n, "fake", 20.0, t.dtype,
                                                     t.numel(), -1, -1))
        finally:
            tr.close()
    return bad


def _hier_p2p(tr: Any, rank: int, n: int, keys: list[str], ctx: Any) -> list[str]:
    """Point-to-point on the hierarchical transport: every rank sends to every other (a big and a
    small message), host-mates through shared memory, others over tcp; then a receive from any
    rank.  Ranks take turns as receivers, so nothing depends on thread scheduling."""
    bad: list[str] = []
    mates = [r for r in range(n) if keys[r] == keys[rank]]
    local_before = sum(tr.local.mail.sent)
    for dst in range(n):
        for src in range(n):
            if src == dst or rank not in (src, dst):
                continue
            size = 200_000 if (src + dst) % 2 else 5
            t = torch.full((size,), float(100 * src + dst))
            c = ctx("send" if rank == src else "recv", t)
            if rank == src:
                tr.send(t, dst, 7, c)
            else:
                got = torch.empty(size)
                if tr.recv(got, src, 7, c) != src or not torch.equal(got, t):
                    bad.append(f"{keys} p2p {src}->{dst}")
    sent_locally = sum(tr.local.mail.sent) - local_before
    if (sent_locally > 0) != (len(mates) > 1):
        bad.append(f"{keys} p2p to host-mates did not use shared memory ({sent_locally} chunks)")
    # any source: rank 0 receives from every other rank, in whatever order they come
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            got = torch.empty(3)
            src = tr.recv(got, None, 9, ctx("recv", got))
            seen.add(src)
            if not torch.equal(got, torch.full((3,), float(src))):
                bad.append(f"{keys} any-source from {src}")
        if seen != set(range(1, n)):
            bad.append(f"{keys} any-source saw {sorted(seen)}")
    else:
        t = torch.full((3,), float(rank))
        tr.send(t, 0, 9, ctx("send", t))
    return bad


# -- simulated hosts (script mode) ---------------------------------------------------------------
def subset_collectives(rank: int, n: int) -> list[str]:
    """Collectives over part of a 3-rank tcp group through the transport interface ([Note: rank
    subsets]): ranks [2, 0] in that order (rank 1 takes no part and is refused); roots and blocks
    index into that list.  Then the whole group is still in step."""
    from ringlet.transport.base import OpContext
    from ringlet.transport.reduce import RedOpType, reduction

    tr = dist.group.WORLD.transport
    R, bad, seq = [2, 0], [], [1000]

    def ctx(op: str, t: torch.Tensor, redop: int = -1, root: int = -1) -> OpContext:
        seq[0] += 1
        return OpContext(op, seq[0], rank, n, "subset", 10.0, t.dtype, t.numel(), root, redop)
    xs = [torch.tensor([1e8, 1.0, -1e8, 3.0]) * (r + 1) + r for r in range(n)]
    if rank not in R:
        try:
            tr.barrier(ctx("barrier", xs[rank]), ranks=R)
            bad.append("a rank outside the subset was not refused")
        except ValueError as e:
            if "not among the ranks taking part" not in str(e):
                bad.append(f"refusal: {e}")
    else:
        m = R.index(rank)
        for op in (RedOpType.SUM, RedOpType.AVG, RedOpType.MAX):
            t, want = xs[rank].clone(), torch.empty(4)
            tr.all_reduce(t, op, None, ctx("all_reduce", t, int(op)), ranks=R)
            reduction(op, None, torch.float32, len(R)).fold_(want, [xs[r] for r in R])
            if not torch.equal(t, want):
                bad.append(f"all_reduce {op.name}: {t.tolist()} != {want.tolist()}")
        out = torch.empty(8)
        tr.all_gather(xs[rank], out, ctx("all_gather", xs[rank]), ranks=R)
        if not torch.equal(out, torch.cat([xs[r] for r in R])):
            bad.append(f"all_gather {out.tolist()}")
        b = xs[rank].clone()
        tr.broadcast(b, 0, ctx("broadcast", b, root=0), ranks=R)
        if not torch.equal(b, xs[R[0]]):
            bad.append(f"broadcast from ranks[0] {b.tolist()}")
        o = torch.empty(2)
        tr.reduce_scatter(xs[rank].clone(), o, RedOpType.SUM, None,
                          ctx("reduce_scatter", o, 0), ranks=R)
        if not torch.equal(o, xs[2][2 * m:2 * m + 2] + xs[0][2 * m:2 * m + 2]):
            bad.append(f"reduce_scatter {o.tolist()}")
    t = torch.ones(3)
    dist.all_reduce(t)
    if t.tolist() != [3.0] * 3:
        bad.append(f"whole group after the subset: {t.tolist()}")
    return bad


def _store(rank: int, outdir: str, master: str, store_timeout: float) -> Any:
    from ringlet.store import TCPStore

    td = timedelta(seconds=store_timeout)
    port_file = os.path.join(outdir, "port")
    if rank == 0:
        store = TCPStore(master, 0, None, is_master=True, timeout=td, wait_for_workers=False)
        tmp = port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(store.port))
        os.replace(tmp, port_file)
        return store
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file):
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never published the store's port")
        time.sleep(0.02)
    with open(port_file) as f:
        port = int(f.read())
    return TCPStore(master, port, None, timeout=td)


def _cut_loop(rank: int, outdir: str) -> dict[str, Any]:
    t = torch.ones(1 << 15)
    steps, t0 = 0, time.monotonic()
    try:
        while True:
            t0 = time.monotonic()
            dist.all_reduce(t)
            t.fill_(1.0)
            steps += 1
            if steps == 20:
                open(os.path.join(outdir, f"looping{rank}"), "w").close()
            if steps > 200_000:
                return {"error": "none"}
    except Exception as e:
        return {"error": type(e).__name__, "message": str(e), "elapsed": time.monotonic() - t0,
                "steps": steps}


def main(argv: list[str]) -> None:
    mode, rank, world, outdir, master, backend, timeout = argv
    r, n, T = int(rank), int(world), float(timeout)
    torch.set_num_threads(1)
    result: dict[str, Any] = {"rank": r}
    store = None
    try:
        # The store lives on host 0: after a cut, host 1's hang report must fail fast, not in 60 s.
        store = _store(r, outdir, master, store_timeout=60.0 if mode == "cases" else 1.5)
        dist.init_process_group(backend, store=store, rank=r, world_size=n,
                                timeout=timedelta(seconds=T))
        result["backend"] = dist.get_backend()
        if mode in ("cases", "both"):
            import _cases

            count, failures = _cases.run_all(r, n)
            result.update(count=count, failures=failures[:20], hier_vs_flat=hier_vs_flat(r, n))
        if mode in ("cut", "both"):
            dist.barrier()
            result.update(_cut_loop(r, outdir))
        else:
            dist.barrier()
    except Exception as e:
        result.update(error=type(e).__name__, message=str(e), traceback=traceback.format_exc())
    with open(os.path.join(outdir, f"rank{r}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(outdir, f"rank{r}.json.tmp"), os.path.join(outdir, f"rank{r}.json"))
    sys.stdout.flush()
    os._exit(0)   # a cut link would make a graceful teardown wait; the test reaps us


if __name__ == "__main__":
    main(sys.argv[1:])
