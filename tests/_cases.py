"""Collective cases checked against a reference (and, in processes, against torch's gloo).

Every rank can compute every other rank's input (inputs are a pure function of
rank and case), so the expected result is computed locally, in rank order, with
torch ops; in the process tier the same call is also made through torch.distributed
on gloo and both results must agree exactly.  Values are small integers, so sums
are exact in every dtype.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

import ringlet.distributed as rdist

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]
# gloo has no AVG/PREMUL_SUM and refuses some dtypes; for those the local reference is the oracle.
GLOO_OPS = {"SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR"}


def make(rank: int, case: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    base = (torch.arange(n, dtype=torch.int64) * 3 + rank * 7 + case) % 5
    if dtype == torch.bool:
        return (base % 2 == 1).reshape(shape)
    return (base + 1).to(dtype).reshape(shape)


def valid(op: str, dtype: torch.dtype) -> bool:
    if op in ("BAND", "BOR", "BXOR"):
        return not dtype.is_floating_point
    if op in ("AVG", "PREMUL_SUM"):
        return dtype.is_floating_point
    return True


def ref_reduce(ts: list[torch.Tensor], op: str) -> torch.Tensor:
    acc = ts[0].clone()
    if op == "PREMUL_SUM":
        acc = acc * 0.5
    for t in ts[1:]:
        if op in ("SUM", "AVG"):
            acc = acc | t if acc.dtype == torch.bool else acc + t
        elif op == "PREMUL_SUM":
            acc = acc + t * 0.5
        elif op == "PRODUCT":
            acc = acc & t if acc.dtype == torch.bool else acc * t
        elif op == "MIN":
            acc = torch.minimum(acc, t)
        elif op == "MAX":
            acc = torch.maximum(acc, t)
        elif op == "BAND":
            acc = acc & t
        elif op == "BOR":
            acc = acc | t
        elif op == "BXOR":
            acc = acc ^ t
    if op == "AVG":
        acc = acc / len(ts)
    return acc.to(ts[0].dtype)


def rop(op: str) -> Any:
    if op == "PREMUL_SUM":
        return rdist._make_nccl_premul_sum(0.5)
    return getattr(rdist.ReduceOp, op)


class Checker:
    def __init__(self, rank: int, n: int, gloo: bool) -> None:
        self.rank, self.n, self.gloo = rank, n, gloo
        self.failures: list[str] = []
        self.count = 0

    def same(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        self.count += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            self.failures.append(f"rank {self.rank}: {what}: got {got.flatten()[:8].tolist()} "
                                 f"{got.dtype}{tuple(got.shape)}, want "
                                 f"{want.flatten()[:8].tolist()} {want.dtype}{tuple(want.shape)}")

    def oracle(self, what: str, got: torch.Tensor, fn: Any) -> None:
        """Also run the same call through torch.distributed (gloo) and compare."""
        if not self.gloo:
            return
        try:
            want = fn()
        except (RuntimeError, ValueError, TypeError) as e:   # gloo refuses this dtype/op
            text = str(e).lower()
            if "not supported" in text or "unsupported" in text or "invalid" in text:
                return
            raise
        self.same(what + " vs gloo", got, want)


def _tdist() -> Any:
    import torch.distributed as tdist

    return tdist


def _top(op: str) -> Any:
    return getattr(_tdist().ReduceOp, op)


def reductions(c: Checker, shapes: list[tuple[int, ...]]) -> None:
    """all_reduce, reduce, reduce_scatter_tensor, reduce_scatter for every dtype x op."""
    n, rank = c.n, c.rank
    case = 0
    for dtype, op, shape in itertools.product(DTYPES, OPS, shapes):
        if not valid(op, dtype):
            continue
        case += 1
        ins = [make(r, case, shape, dtype) for r in range(n)]
        want = ref_reduce(ins, op)
        tag = f"{op} {dtype} {shape}"
        t = ins[rank].clone()
        rdist.all_reduce(t, op=rop(op))
        c.same(f"all_reduce {tag}", t, want)
        if op in GLOO_OPS:
            def g() -> torch.Tensor:
                u = ins[rank].clone()
                _tdist().all_reduce(u, op=_top(op))
                return u
            c.oracle(f"all_reduce {tag}", t, g)
        root = case % n
        t = ins[rank].clone()
        rdist.reduce(t, dst=root, op=rop(op))
        c.same(f"reduce root={root} {tag}", t, want if rank == root else ins[rank])
        # reduce_scatter: input = n blocks of `shape`
        big = [torch.cat([make(r, case + b, shape, dtype).reshape(-1) for b in range(n)])
               for r in range(n)]
        want_rs = ref_reduce([big[r].view(n, -1)[rank] for r in range(n)], op)
        out = torch.empty_like(want_rs)
        rdist.reduce_scatter_tensor(out, big[rank].clone(), op=rop(op))
        c.same(f"reduce_scatter_tensor {tag}", out, want_rs)
        out2 = torch.empty_like(want_rs)
        rdist.reduce_scatter(out2, list(big[rank].clone().view(n, -1).unbind(0)), op=rop(op))
        c.same(f"reduce_scatter {tag}", out2, want_rs)
        if op in GLOO_OPS and dtype in (torch.float32, torch.int64):
            def g2() -> torch.Tensor:
                o = torch.empty_like(want_rs)
                _tdist().reduce_scatter_single(o, big[rank].clone(), op=_top(op))
                return o
            c.oracle(f"reduce_scatter_tensor {tag}", out, g2)


def movement(c: Checker, shapes: list[tuple[int, ...]]) -> None:
    """broadcast, all_gather(_into_tensor), gather, scatter, all_to_all(_single) for every dtype."""
    n, rank = c.n, c.rank
    for case, (dtype, shape) in enumerate(itertools.product(DTYPES, shapes)):
        ins = [make(r, case, shape, dtype) for r in range(n)]
        tag = f"{dtype} {shape}"
        root = case % n
        t = ins[rank].clone()
        rdist.broadcast(t, src=root)
        c.same(f"broadcast src={root} {tag}", t, ins[root])
        def gb() -> torch.Tensor:
            u = ins[rank].clone()
            _tdist().broadcast(u, src=root)
            return u
        c.oracle(f"broadcast {tag}", t, gb)
        out = torch.empty((n * shape[0],) + shape[1:] if shape else (n,), dtype=dtype)
        rdist.all_gather_into_tensor(out, ins[rank])
        want = torch.cat([i.reshape((-1,) + shape[1:]) if shape else i.reshape(1) for i in ins])
        c.same(f"all_gather_into_tensor {tag}", out, want)
        def gg() -> torch.Tensor:
            o = torch.empty_like(out)
            _tdist().all_gather_single(o, ins[rank])
            return o
        c.oracle(f"all_gather_into_tensor {tag}", out, gg)
        lst = [torch.empty_like(ins[0]) for _ in range(n)]
        rdist.all_gather(lst, ins[rank])
        for r in range(n):
            c.same(f"all_gather[{r}] {tag}", lst[r], ins[r])
        glist = [torch.empty_like(ins[0]) for _ in range(n)] if rank == root else None
        rdist.gather(ins[rank], glist, dst=root)
        if glist is not None:
            for r in range(n):
                c.same(f"gather[{r}] dst={root} {tag}", glist[r], ins[r])
        sc = torch.empty_like(ins[0])
        parts = [make(root, case + 100 + r, shape, dtype) for r in range(n)]
        rdist.scatter(sc, parts if rank == root else None, src=root)
        c.same(f"scatter src={root} {tag}", sc, parts[rank])
        send = [make(rank, case + 10 * j, shape, dtype) for j in range(n)]
        recv = [torch.empty_like(ins[0]) for _ in range(n)]
        rdist.all_to_all(recv, send)
        for r in range(n):
            c.same(f"all_to_all from {r} {tag}", recv[r], make(r, case + 10 * rank, shape, dtype))


def all_to_all_uneven(c: Checker) -> None:
    n, rank = c.n, c.rank
    # rank r sends (r + j + 1) rows of width 3 to rank j
    in_splits = [rank + j + 1 for j in range(n)]
    out_splits = [r + rank + 1 for r in range(n)]
    inp = torch.cat([torch.full((rank + j + 1, 3), 100 * rank + j, dtype=torch.float32)
                     for j in range(n)])
    out = torch.empty(sum(out_splits), 3)
    rdist.all_to_all_single(out, inp, out_splits, in_splits)
    want = torch.cat([torch.full((r + rank + 1, 3), 100 * r + rank, dtype=torch.float32)
                      for r in range(n)])
    c.same("all_to_all_single uneven", out, want)
    if c.gloo:
        def g() -> torch.Tensor:
            o = torch.empty_like(out)
            _tdist().all_to_all_single(o, inp, out_splits, in_splits)
            return o
        c.oracle("all_to_all_single uneven", out, g)
    even = torch.arange(4 * n, dtype=torch.int64) + 1000 * rank
    out_e = torch.empty_like(even)
    rdist.all_to_all_single(out_e, even)
    want_e = torch.cat([torch.arange(4 * rank, 4 * rank + 4) + 1000 * r for r in range(n)])
    c.same("all_to_all_single even", out_e, want_e)


def strided(c: Checker) -> None:
    """Non-contiguous inputs and outputs: results land in the user's view, neighbours untouched."""
    n, rank = c.n, c.rank
    base = [make(r, 7, (6, 8), torch.float32) for r in range(n)]
    views = {
        "transpose": lambda t: t.T,
        "every other column": lambda t: t[:, ::2],
        "sub-block": lambda t: t[1:4, 2:7],
    }
    for name, view in views.items():
        buf = base[rank].clone()
        v = view(buf)
        keep = buf.clone()
        rdist.all_reduce(v)
        want = ref_reduce([view(b) for b in base], "SUM")
        c.same(f"all_reduce strided {name}", v, want)
        mask = torch.ones_like(buf, dtype=torch.bool)
        view(mask).fill_(False)
        c.same(f"all_reduce strided {name} untouched", buf[mask], keep[mask])
        buf = base[rank].clone()
        v = view(buf)
        rdist.broadcast(v, src=n - 1)
        c.same(f"broadcast strided {name}", v, view(base[n - 1]))
        out_base = torch.zeros(n * 10, 9)
        outv = out_base[:, 1:1 + v.shape[1]][: n * v.shape[0]] if v.shape[1] < 9 else None
        if outv is not None:
            rdist.all_gather_into_tensor(outv, view(base[rank]))
            c.same(f"all_gather_into_tensor strided out {name}", outv,
                   torch.cat([view(b) for b in base]))


def edges(c: Checker) -> None:
    n, rank = c.n, c.rank
    z = torch.empty(0)
    rdist.all_reduce(z)
    c.same("all_reduce 0-element", z, torch.empty(0))
    s = torch.tensor(float(rank + 1))
    rdist.all_reduce(s)
    c.same("all_reduce 0-d", s, torch.tensor(float(n * (n + 1) // 2)))
    out = torch.empty(0)
    rdist.all_gather_into_tensor(out, torch.empty(0))
    c.same("all_gather 0-element", out, torch.empty(0))
    # larger than a slot: exercises chunking (inproc slots are 64 KiB, shm 1 MiB)
    big = torch.arange(300_001, dtype=torch.float64) % 7 + rank
    rdist.all_reduce(big)
    c.same("all_reduce chunked", big,
           sum(torch.arange(300_001, dtype=torch.float64) % 7 + r for r in range(n)))
    out = torch.empty(n * 70_001, dtype=torch.int32)
    rdist.all_gather_into_tensor(out, torch.full((70_001,), rank, dtype=torch.int32))
    c.same("all_gather chunked", out, torch.arange(n, dtype=torch.int32).repeat_interleave(70_001))
    rs = torch.empty(50_001, dtype=torch.float32)
    rdist.reduce_scatter_tensor(rs, torch.ones(n * 50_001))
    c.same("reduce_scatter chunked", rs, torch.full((50_001,), float(n)))
    # in place: the output is this rank's block of the input (as FSDP-style callers pass it);
    # (integer-valued floats: exact in any fold order, which differs across hosts)
    for op in ("SUM", "MAX", "PREMUL_SUM"):
        xs = [torch.randint(-50, 50, (n * 50_001,),
                            generator=torch.Generator().manual_seed(100 + r)).float()
              for r in range(n)]
        mine = xs[rank].clone()
        blk = mine[rank * 50_001:(rank + 1) * 50_001]
        rdist.reduce_scatter_tensor(blk, mine, op=rop(op))
        c.same(f"reduce_scatter in place {op}", blk,
               ref_reduce([x[rank * 50_001:(rank + 1) * 50_001] for x in xs], op))
    bc = torch.full((200_003,), float(rank), dtype=torch.float32)
    rdist.broadcast(bc, src=1)
    c.same("broadcast chunked", bc, torch.full((200_003,), 1.0))


def p2p(c: Checker) -> None:
    n, rank = c.n, c.rank
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    # a ring of large isend/irecv in one batch cannot deadlock
    out = torch.full((100_000,), float(rank))
    inc = torch.empty(100_000)
    works = rdist.batch_isend_irecv([rdist.P2POp(rdist.isend, out, nxt),
                                     rdist.P2POp(rdist.irecv, inc, prv)])
    for w in works:
        w.wait()
    c.same("batch_isend_irecv ring", inc, torch.full((100_000,), float(prv)))
    if rank == 0:
        for dst in range(1, n):
            rdist.send(torch.full((5,), dst, dtype=torch.int64), dst=dst, tag=3)
        got = torch.empty(3)
        srcs = sorted(rdist.recv(got) for _ in range(1, n))
        c.same("recv any source", torch.tensor(srcs), torch.arange(1, n))
    else:
        t = torch.empty(5, dtype=torch.int64)
        src = rdist.recv(t, src=0, tag=3)
        c.same("send/recv", t, torch.full((5,), rank, dtype=torch.int64))
        c.same("recv returns src", torch.tensor(src), torch.tensor(0))
        rdist.send(torch.ones(3), dst=0)


def objects(c: Checker) -> None:
    n, rank = c.n, c.rank
    lst: list[Any] = [None] * n
    rdist.all_gather_object(lst, {"rank": rank, "t": torch.ones(2) * rank})
    ok = all(lst[r]["rank"] == r and torch.equal(lst[r]["t"], torch.ones(2) * r) for r in range(n))
    c.same("all_gather_object", torch.tensor(ok), torch.tensor(True))
    objs = [f"from {rank}", rank, None] if rank == 1 else [None, None, None]
    rdist.broadcast_object_list(objs, src=1)
    c.same("broadcast_object_list", torch.tensor(objs == ["from 1", 1, None]), torch.tensor(True))
    gl = [None] * n if rank == 0 else None
    rdist.gather_object(("g", rank), gl, dst=0)
    if rank == 0:
        c.same("gather_object", torch.tensor(gl == [("g", r) for r in range(n)]),
               torch.tensor(True))
    outl: list[Any] = [None]
    rdist.scatter_object_list(outl,
                              [{"to": r} for r in range(n)] if rank == n - 1 else None, src=n - 1)
    c.same("scatter_object_list", torch.tensor(outl[0] == {"to": rank}), torch.tensor(True))
    if rank == 0:
        rdist.send_object_list([{"x": 1}, [2, 3]], dst=1)
    elif rank == 1:
        got: list[Any] = [None, None]
        rdist.recv_object_list(got, src=0)
        c.same("send/recv_object_list", torch.tensor(got == [{"x": 1}, [2, 3]]), torch.tensor(True))


def run_all(rank: int, n: int, gloo_file: str | None = None) -> tuple[int, list[str]]:
    """Every case; returns (number of checks, failures).  ``gloo_file``: also compare with gloo."""
    gloo = gloo_file is not None
    if gloo:
        _tdist().init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank,
                                    world_size=n)
    try:
        c = Checker(rank, n, gloo)
        reductions(c, [(5,), (2, 3)])
        movement(c, [(4,), (3, 2)])
        all_to_all_uneven(c)
        strided(c)
        edges(c)
        p2p(c)
        objects(c)
        rdist.barrier()
        return c.count, c.failures
    finally:
        if gloo:
            _tdist().destroy_process_group()
