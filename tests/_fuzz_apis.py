"""Drivers of the fuzz engine (see tests/_fuzz_cases.py): one function per public API builds the
call of a case on this rank and the check of its results, and :func:`run_cases` runs a list
of cases on every rank of a world, with the verdict, deadline and usability checks."""

from __future__ import annotations

import time
import traceback
from datetime import timedelta
from typing import Any

import torch
from _cases import make, ref_reduce, rop
from _fuzz_cases import APIS, DEADLINE, FAULT_VALUES, Maker, N, logical, refused

import ringlet.distributed as dist
from ringlet.errors import DistBackendError

_NOTHING = object()


class Env:
    """One rank's view of one case: argument builders, fault values and the expected verdict."""

    def __init__(self, c: dict[str, Any], rank: int, maker: Maker) -> None:
        self.c, self.rank, self.maker = c, rank, maker
        self.dt = getattr(torch, c["dtype"])
        self.shape = tuple(c["shape"])
        self.reject = False                       # the contract says: this call must be refused
        self.passed: list[tuple[torch.Tensor, torch.Tensor]] = []   # (tensor, its values before)
        self.fault = c["fault"]
        self.fval = FAULT_VALUES[self.fault][c["fval"]] if self.fault else None
        self.op = c["op"]

    # -- values and arguments ------------------------------------------------------------------
    def vals(self, r: int, salt: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        shape = self.shape if shape is None else shape
        v = make(r, self.c["cid"] * 16 + salt, shape, self.dt)
        if self.dt.is_complex:        # an imaginary part, so that conjugate views matter
            v = torch.complex(v.real, v.real - 2).to(self.dt)
        return v

    def kind(self, slot: str) -> str:
        return self.c["kind"] if slot == self.c["slot"] else "contig"

    def arg(self, slot: str, role: str, salt: int, shape: tuple[int, ...] | None = None) -> Any:
        """This rank's argument for ``slot`` (values of salt ``salt``)."""
        shape = self.shape if shape is None else shape
        kind = self.kind(slot)
        x = self.maker.build(kind, self.vals(self.rank, salt, shape))
        self.reject |= refused(kind, role, x, shape)
        if isinstance(x, torch.Tensor) and x.layout is torch.strided and not x.is_meta \
                and not x.is_nested and not x.is_quantized \
                and type(x) in (torch.Tensor, torch.nn.Parameter) and x.untyped_storage().nbytes():
            self.passed.append((x, logical(x)))
        return x

    def logical_in(self, slot: str, r: int, salt: int,
                   shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """What rank ``r`` passes in ``slot``, as values (for expected results of valid cases)."""
        shape = self.shape if shape is None else shape
        return logical(self.maker.build(self.kind(slot), self.vals(r, salt, shape)))

    def op_arg(self) -> Any:
        if self.fault != "op":
            return rop(self.op)
        v = self.fval
        if v in ("BAND", "MIN"):
            bad = (self.dt.is_floating_point or self.dt.is_complex if v == "BAND"
                   else self.dt.is_complex)
            self.reject |= bad
            self.op = v
            return rop(v)
        self.reject = True
        return getattr(dist.ReduceOp, v) if v in ("PREMUL_SUM", "UNUSED") else v

    def group_arg(self) -> Any:
        if self.fault != "group":
            return None
        self.reject = True
        if self.fval == "destroyed":
            g = dist.new_group()
            dist.destroy_process_group(g)
            return g
        return self.fval

    def rank_arg(self, default: int) -> Any:
        if self.fault == "rank":
            self.reject = True
            return self.fval
        return default

    def numel_fault(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.fault == "numel":
            self.reject = True
            return (max(1, _numel(shape)) + 1,)
        return shape

    def dtype_fault(self) -> bool:
        if self.fault == "dtype_mix":
            self.reject = True
            return True
        return False

    def len_fault(self, n: int) -> int:
        if self.fault == "len":
            self.reject = True
            return [0, n + 1][self.fval]
        return n

    def untouched(self) -> str | None:
        for x, before in self.passed:
            if not torch.equal(logical(x), before):
                return f"a refused call changed a tensor: {before.flatten()[:6].tolist()} -> " \
                       f"{logical(x).flatten()[:6].tolist()}"
        return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def same(got: Any, want: torch.Tensor, what: str) -> str | None:
    g = logical(got)
    if g.dtype != want.dtype or g.shape != want.shape or not torch.equal(g, want):
        return f"{what}: got {g.flatten()[:6].tolist()} {g.dtype}{tuple(g.shape)}, want " \
               f"{want.flatten()[:6].tolist()} {want.dtype}{tuple(want.shape)}"
    return None


def first(*checks: str | None) -> str | None:
    return next((c for c in checks if c), None)


# -- one driver per API: returns (call, check)
# ------------------------------------------------------
def d_all_reduce(E: Env) -> tuple[Any, Any]:
    x, op, g = E.arg("t", "inout", 0), E.op_arg(), E.group_arg()
    return (lambda: dist.all_reduce(x, op=op, group=g),
            lambda: same(x, ref_reduce([E.logical_in("t", r, 0) for r in range(N)], E.op),
                         "all_reduce"))


def d_reduce(E: Env) -> tuple[Any, Any]:
    x, op, g = E.arg("t", "inout", 0), E.op_arg(), E.group_arg()
    dst = E.rank_arg(E.c["root"])

    def check() -> str | None:
        mine = E.logical_in("t", E.rank, 0)
        want = (ref_reduce([E.logical_in("t", r, 0) for r in range(N)], E.op)
                if E.rank == dst else mine)
        return same(x, want, "reduce")
    return lambda: dist.reduce(x, dst=dst, op=op, group=g), check


def d_broadcast(E: Env) -> tuple[Any, Any]:
    x, g = E.arg("t", "inout", 0), E.group_arg()
    src = E.rank_arg(E.c["root"])
    return (lambda: dist.broadcast(x, src=src, group=g),
            lambda: same(x, E.logical_in("t", src, 0), "broadcast"))


def d_all_gather(E: Env) -> tuple[Any, Any]:
    t, g = E.arg("t", "in", 0), E.group_arg()
    outs = [E.arg("out", "out", 1) for _ in range(E.len_fault(N))]
    if E.dtype_fault() and outs:
        outs[-1] = torch.zeros(E.shape,
                               dtype=torch.float64 if E.dt != torch.float64 else torch.int32)
    if E.fault == "numel":
        outs[E.rank] = torch.zeros(E.numel_fault(E.shape), dtype=E.dt)

    def check() -> str | None:
        return first(*[same(o, E.logical_in("t", r, 0), f"all_gather[{r}]")
                       for r, o in enumerate(outs)])
    return lambda: dist.all_gather(outs, t, group=g), check


def d_all_gather_into_tensor(E: Env, fn: Any = None) -> tuple[Any, Any]:
    t = E.arg("t", "in", 0)
    out_shape = E.numel_fault((N * _numel(E.shape),) if E.shape else (N,))
    out = E.arg("out", "out", 1, out_shape)
    if E.dtype_fault():
        out = torch.zeros(out_shape, dtype=torch.float64 if E.dt != torch.float64 else torch.int32)
    call = fn or dist.all_gather_into_tensor

    def check() -> str | None:
        want = torch.cat([E.logical_in("t", r, 0).reshape(-1) for r in range(N)]).reshape(out_shape)
        return same(out, want, "all_gather_into_tensor")
    return lambda: call(out, t), check


def d__all_gather_base(E: Env) -> tuple[Any, Any]:
    return d_all_gather_into_tensor(E, dist._all_gather_base)


def d_reduce_scatter(E: Env) -> tuple[Any, Any]:
    out, op = E.arg("out", "out", 1), E.op_arg()
    ins = [E.arg("in", "in", 2 + j) for j in range(E.len_fault(N))]
    if E.dtype_fault() and ins:
        ins[-1] = torch.zeros(E.shape,
                              dtype=torch.float64 if E.dt != torch.float64 else torch.int32)
    if E.fault == "numel":
        ins[0] = torch.zeros(E.numel_fault(E.shape), dtype=E.dt)

    def check() -> str | None:
        want = ref_reduce([E.logical_in("in", r, 2 + E.rank) for r in range(N)], E.op)
        return same(out, want, "reduce_scatter")
    return lambda: dist.reduce_scatter(out, ins, op=op), check


def d_reduce_scatter_tensor(E: Env, fn: Any = None) -> tuple[Any, Any]:
    out, op, g = E.arg("out", "out", 1), E.op_arg(), E.group_arg()
    in_shape = E.numel_fault((N * _numel(E.shape),) if E.shape else (N,))
    inp = E.arg("in", "in", 2, in_shape)
    if E.dtype_fault():
        inp = torch.zeros(in_shape, dtype=torch.float64 if E.dt != torch.float64 else torch.int32)
    call = fn or (lambda o, i, op: dist.reduce_scatter_tensor(o, i, op=op, group=g))

    def check() -> str | None:
        k = _numel(E.shape)
        blocks = [E.logical_in("in", r, 2, in_shape).reshape(-1)[E.rank * k:(E.rank + 1) * k]
                  for r in range(N)]
        return same(out, ref_reduce(blocks, E.op).reshape(E.shape), "reduce_scatter_tensor")
    return lambda: call(out, inp, op), check


def d__reduce_scatter_base(E: Env) -> tuple[Any, Any]:
    return d_reduce_scatter_tensor(E, lambda o, i, op: dist._reduce_scatter_base(o, i, op=op))


def d_all_reduce_coalesced(E: Env) -> tuple[Any, Any]:
    op = E.op_arg()
    E.reject |= E.fault == "len"               # an empty list; any other length is valid here
    ts = [E.arg("t", "inout", j) for j in range(0 if E.fault == "len" else 2)]
    if E.dtype_fault():
        ts.append(torch.zeros(2, dtype=torch.float64 if E.dt != torch.float64 else torch.int32))

    def check() -> str | None:
        return first(*[same(t,
                            ref_reduce([E.logical_in("t", r, j) for r in range(N)], E.op), f"[{j}]")
                       for j, t in enumerate(ts)])
    return lambda: dist.all_reduce_coalesced(ts, op=op), check


def d_all_gather_coalesced(E: Env) -> tuple[Any, Any]:
    ins = [E.arg("t", "in", j) for j in range(2)]
    outs = [[E.arg("out", "out", 5 + r * 2 + j) for j in range(2)] for r in range(E.len_fault(N))]
    if E.dtype_fault():
        outs[0][0] = torch.zeros(E.shape,
                                 dtype=torch.float64 if E.dt != torch.float64 else torch.int32)
    if E.fault == "numel":
        outs[0][1] = torch.zeros(E.numel_fault(E.shape), dtype=E.dt)

    def check() -> str | None:
        return first(*[same(o, E.logical_in("t", r, j), f"[{r}][{j}]")
                       for r, lst in enumerate(outs) for j, o in enumerate(lst)])
    return lambda: dist.all_gather_coalesced(outs, ins), check


def d_all_to_all(E: Env) -> tuple[Any, Any]:
    k = E.len_fault(N)
    ins = [E.arg("in", "in", 2 + j) for j in range(k)]
    outs = [E.arg("out", "out", 7 + j) for j in range(k)]
    if E.dtype_fault() and outs:
        outs[0] = torch.zeros(E.shape,
                              dtype=torch.float64 if E.dt != torch.float64 else torch.int32)

    def check() -> str | None:
        return first(*[same(o, E.logical_in("in", r, 2 + E.rank), f"all_to_all[{r}]")
                       for r, o in enumerate(outs)])
    return lambda: dist.all_to_all(outs, ins), check


def d_all_to_all_single(E: Env) -> tuple[Any, Any]:
    rows = 2 * N
    shape = (rows,) + tuple(E.shape[1:])
    inp, out = E.arg("in", "in", 2, shape), E.arg("out", "out", 1, shape)
    splits: Any = None
    if E.fault == "split":
        E.reject, splits = True, E.fval
    if E.dtype_fault():
        out = torch.zeros(shape, dtype=torch.float64 if E.dt != torch.float64 else torch.int32)

    def check() -> str | None:
        per = rows // N
        want = torch.cat([E.logical_in("in", r, 2, shape)[E.rank * per:(E.rank + 1) * per]
                          for r in range(N)])
        return same(out, want, "all_to_all_single")
    return lambda: dist.all_to_all_single(out, inp, splits, splits), check


def d_gather(E: Env) -> tuple[Any, Any]:
    t = E.arg("t", "in", 0)
    dst = E.rank_arg(E.c["root"])
    lst = [E.arg("list", "out", 9 + r) for r in range(N)] if E.rank == dst else None

    def check() -> str | None:
        if lst is None:
            return None
        return first(*[same(o, E.logical_in("t", r, 0), f"gather[{r}]") for r, o in enumerate(lst)])
    return lambda: dist.gather(t, lst, dst=dst), check


def d_scatter(E: Env) -> tuple[Any, Any]:
    t = E.arg("t", "out", 0)
    src = E.rank_arg(E.c["root"])
    lst = [E.arg("list", "in", 9 + r) for r in range(N)] if E.rank == src else None
    return (lambda: dist.scatter(t, lst, src=src),
            lambda: same(t, E.logical_in("list", src, 9 + E.rank), "scatter"))


def _p2p_args(E: Env) -> tuple[Any, Any, Any]:
    x = E.arg("t", "in" if E.rank == 0 else "out", 0)
    peer = E.rank_arg(1 - E.rank)
    tag = 3
    if E.fault == "tag":
        E.reject, tag = True, E.fval
    return x, peer, tag


def d_send_recv(E: Env) -> tuple[Any, Any]:
    x, peer, tag = _p2p_args(E)
    g = E.group_arg()
    if E.rank == 0:
        return lambda: dist.send(x, dst=peer, group=g, tag=tag), lambda: None
    return (lambda: dist.recv(x, src=peer, group=g, tag=tag),
            lambda: same(x, E.logical_in("t", 0, 0), "recv"))


def d_isend_irecv(E: Env) -> tuple[Any, Any]:
    x, peer, tag = _p2p_args(E)
    if E.rank == 0:
        return lambda: dist.isend(x, dst=peer, tag=tag).wait(), lambda: None
    return (lambda: dist.irecv(x, src=peer, tag=tag).wait(),
            lambda: same(x, E.logical_in("t", 0, 0), "irecv"))


def d_batch_isend_irecv(E: Env) -> tuple[Any, Any]:
    a, b = E.arg("send", "in", 0), E.arg("recv", "out", 1)
    peer = E.rank_arg(1 - E.rank)
    tag = 5
    if E.fault == "tag":
        E.reject, tag = True, E.fval
    ops: list[Any] = [dist.P2POp(dist.isend, a, peer, tag=tag),
                      dist.P2POp(dist.irecv, b, peer, tag=tag)]
    if E.fault == "entry":
        E.reject = True
        ops.append(a)

    def call() -> None:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return call, lambda: same(b, E.logical_in("send", 1 - E.rank, 0), "batch recv")


def d_barrier(E: Env) -> tuple[Any, Any]:
    kw: dict[str, Any] = {"timeout": timedelta(seconds=5), "device_ids": None,
                          "group": E.group_arg()}
    if E.fault in ("timeout", "device_ids"):
        E.reject, kw[E.fault] = True, E.fval
    return lambda: dist.barrier(**kw), lambda: None


def d_monitored_barrier(E: Env) -> tuple[Any, Any]:
    timeout: Any = timedelta(seconds=5)
    if E.fault == "timeout":
        E.reject, timeout = True, E.fval
    return lambda: dist.monitored_barrier(timeout=timeout), lambda: None


def _obj(E: Env, r: int) -> Any:
    return {"rank": r, "t": E.logical_in("obj", r, 0)}


def _same_obj(got: Any, want: Any, what: str) -> str | None:
    if not isinstance(got, dict) or got.get("rank") != want["rank"]:
        return f"{what}: got {got!r}, want {want!r}"
    return same(got["t"], want["t"], what)


def d_all_gather_object(E: Env) -> tuple[Any, Any]:
    out: list[Any] = [None] * E.len_fault(N)
    obj = {"rank": E.rank, "t": E.arg("obj", "in", 0)}
    return (lambda: dist.all_gather_object(out, obj),
            lambda: first(*[_same_obj(o, _obj(E, r), f"[{r}]") for r, o in enumerate(out)]))


def d_broadcast_object_list(E: Env) -> tuple[Any, Any]:
    src = E.rank_arg(E.c["root"])
    lst = [{"rank": E.rank, "t": E.arg("obj", "in", 0)}, "x"]
    return (lambda: dist.broadcast_object_list(lst, src=src),
            lambda: _same_obj(lst[0], _obj(E, src), "broadcast_object_list"))


def d_gather_object(E: Env) -> tuple[Any, Any]:
    dst = E.rank_arg(E.c["root"])
    out: list[Any] | None = [None] * N if E.rank == dst else None
    obj = {"rank": E.rank, "t": E.arg("obj", "in", 0)}

    def check() -> str | None:
        return (first(*[_same_obj(o, _obj(E, r), f"[{r}]") for r, o in enumerate(out)])
                if out else None)
    return lambda: dist.gather_object(obj, out, dst=dst), check


def d_scatter_object_list(E: Env) -> tuple[Any, Any]:
    src = E.rank_arg(E.c["root"])
    ins = [{"rank": r, "t": E.arg("obj", "in", 0)} for r in range(N)] if E.rank == src else None
    out: list[Any] = [None]
    return (lambda: dist.scatter_object_list(out, ins, src=src),
            lambda: _same_obj(out[0], {"rank": E.rank, "t": E.logical_in("obj", src, 0)},
                              "scatter_object_list"))


def d_send_recv_object_list(E: Env) -> tuple[Any, Any]:
    peer = E.rank_arg(1 - E.rank)
    batch = E.c["cid"] % 2 == 1
    if E.rank == 0:
        lst = [{"rank": 0, "t": E.arg("obj", "in", 0)}]
        return lambda: dist.send_object_list(lst, dst=peer, use_batch=batch), lambda: None
    got: list[Any] = [None]
    return (lambda: dist.recv_object_list(got, src=peer, use_batch=batch),
            lambda: _same_obj(got[0], _obj(E, 0), "recv_object_list"))


def d_coalescing_manager(E: Env) -> tuple[Any, Any]:
    op = E.op_arg()
    a, b = E.arg("t", "inout", 0), E.arg("t", "inout", 1)
    out_shape = (N * _numel(E.shape),) if E.shape else (N,)
    out = E.arg("out", "out", 2, out_shape)
    small = E.vals(E.rank, 3)
    asyncs = E.c["cid"] % 2 == 0

    def call() -> None:
        with dist._coalescing_manager(async_ops=asyncs) as cm:
            dist.all_reduce(a, op=op)
            dist.all_gather_into_tensor(out, small)
            dist.all_reduce(b, op=op)
        cm.wait()

    def check() -> str | None:
        gathered = torch.cat([E.vals(r, 3).reshape(-1) for r in range(N)]).reshape(out_shape)
        return first(same(a, ref_reduce([E.logical_in("t", r, 0) for r in range(N)], E.op), "a"),
                     same(b, ref_reduce([E.logical_in("t", r, 1) for r in range(N)], E.op), "b"),
                     same(out, gathered, "gathered"))
    return call, check


DRIVERS = {name: globals()[f"d_{name}"] for name in APIS}


# -- the loop
# ------------------------------------------------------------------------------------------
_REFUSALS = (TypeError, ValueError, DistBackendError)


def _probe(rank: int) -> bool:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return float(t) == N * (N + 1) / 2


def run_case(c: dict[str, Any], rank: int, maker: Maker) -> tuple[str, str | None]:
    """(verdict, failure): verdict "rejected" or "passed"; failure None or what went wrong."""
    E = Env(c, rank, maker)
    pg = dist.group.WORLD
    call, check = DRIVERS[c["api"]](E)
    seq = pg.seq
    t0 = time.monotonic()
    err: BaseException | None = None
    try:
        call()
    except _REFUSALS as e:
        err = e
    except Exception as e:
        return "error", f"unexpected {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
    took = time.monotonic() - t0
    if took > DEADLINE:
        return "error", f"took {took:.1f} s (deadline {DEADLINE} s)"
    if err is not None:
        if not E.reject:
            return "error", f"a valid call was refused: {type(err).__name__}: {err}"
        if pg.seq != seq:
            return "error", f"refused after taking a sequence number ({seq} -> {pg.seq}): {err}"
        return "rejected", E.untouched()
    if E.reject:
        return "error", "a bad call was accepted"
    return "passed", check()


def run_cases(rank: int, n: int, cases: list[dict[str, Any]],
              progress: str | None = None) -> dict[str, Any]:
    """Run ``cases`` in order on this rank; returns counts and failures (see the module
    docstring)."""
    from ringlet.distributed.device_mesh import init_device_mesh

    maker = Maker(rank, init_device_mesh("cpu", (n,)))
    counts = {"run": 0, "rejected": 0, "passed": 0}
    failures: list[str] = []
    try:
        for i, c in enumerate(cases):
            if progress:
                with open(f"{progress}.{rank}", "w") as f:
                    f.write(f"{i} {c}\n")
            verdict, failure = run_case(c, rank, maker)
            counts["run"] += 1
            if verdict in counts:
                counts[verdict] += 1
            if failure:
                failures.append(f"rank {rank} case {i} {c}: {failure}")
            try:
                ok = _probe(rank)
            except Exception as e:
                ok, failure = False, f"{type(e).__name__}: {e}"
            if not ok:
                failures.append(f"rank {rank} case {i} {c}: the group is unusable afterwards "
                                f"({verdict}; {failure or 'wrong all_reduce'})")
                break
            maker.close()
    finally:
        maker.close()
    return {"counts": counts, "failures": failures}
