"""Collective and point-to-point algorithms over an :class:`~ringlet.transport.arena.Arena`.

See [Note: arena protocol] in ``arena.py``.  Every collective is a sequence of
rounds; large tensors stream through the slots in chunks of ``slot_bytes``.
At the sizes and rank counts of one host (2-8 ranks) the "direct" algorithm --
every rank reads every slot and reduces in rank order -- needs one flag wait
per chunk and beat reduce-scatter + all-gather in the measurements recorded in
DESIGN.md (16 us vs 46 us at 8 B, 2 ranks).  Reducing in rank order on every
rank makes the results bit-identical across ranks.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any, cast

import numpy as np
import torch

from ringlet import _env
from ringlet.errors import CollectiveMismatchError, DistBackendError
from ringlet.transport.arena import C_DEPARTED, C_DONE, C_ENTERED, C_PID, SLOT_HDR, Arena
from ringlet.transport.base import OpContext, Transport, describe_fingerprint
from ringlet.transport.reduce import RedOpType, combine_, finish_, prepare_contribution

__all__ = ["FAST_BYTES", "ArenaTransport"]

# Messages up to FAST_BYTES take the small-message path: ctypes.memmove in and out of the
# arena and numpy ufuncs for the reduction.  torch ops cost 3-6 us each in fixed overhead
# here (measured on this 2-core machine), numpy ~1 us: that is the difference between
# ~90 us and ~15 us for an 8-byte all_reduce.
FAST_BYTES = 16 * 1024
_memmove = ctypes.memmove
_NP_DTYPES: dict[torch.dtype, type] = {
    torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64, torch.int32: np.int32,
    torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
}
try:   # numpy's own errstate costs ~3 us a call; setting its context variable directly ~0.2 us
    from numpy._core.umath import _extobj_contextvar, _make_extobj

    _QUIET = _make_extobj(all="ignore")

    def _quiet() -> object:
        return _extobj_contextvar.set(_QUIET)

    def _loud(token: object) -> None:
        _extobj_contextvar.reset(token)   # type: ignore[arg-type]
except ImportError:  # pragma: no cover - other numpy versions
    def _quiet() -> object:
        state = np.errstate(all="ignore")
        state.__enter__()
        return state

    def _loud(token: object) -> None:
        token.__exit__(None, None, None)  # type: ignore[attr-defined]

_FAST_CACHE_MAX = 256
_UFUNCS = {
    RedOpType.SUM: np.add, RedOpType.AVG: np.add, RedOpType.PRODUCT: np.multiply,
    RedOpType.MIN: np.minimum, RedOpType.MAX: np.maximum, RedOpType.BAND: np.bitwise_and,
    RedOpType.BOR: np.bitwise_or, RedOpType.BXOR: np.bitwise_xor,
}


def _foldable_in_place(fi: torch.Tensor, fo: torch.Tensor, me: int, n: int, N: int) -> bool:
    """Whether reduce-scatter may fold block ``me`` of ``fi`` straight into ``fo``: they do not
    overlap, or ``fo`` *is* that block and it comes first in the fold (or is one of two)."""
    size = fo.element_size()
    lo, hi = fi.data_ptr(), fi.data_ptr() + fi.numel() * size
    olo, ohi = fo.data_ptr(), fo.data_ptr() + N * size
    if ohi <= lo or olo >= hi:
        return True
    return olo == lo + me * N * size and (me == 0 or n == 2)


def _chunks(total: int, cap: int) -> Iterator[tuple[int, int, int]]:
    """(index, offset, count) pieces of ``total`` items, at least one (a 0-item round still syncs)."""
    if total <= cap:
        yield 0, 0, total
        return
    for k, off in enumerate(range(0, total, cap)):
        yield k, off, min(cap, total - off)


class ArenaTransport(Transport):
    """Algorithms shared by the ``shm`` (processes) and ``inproc`` (threads) transports."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.rank = arena.rank
        self.world_size = arena.world_size
        self.step = 0
        lay = arena.layout
        n = self.world_size
        self.q = arena.q
        self._hdr_i = [[lay.slot_hdr_off(r, b) // 8 for b in (0, 1)] for r in range(n)]
        self._sent = [0] * n     # mailbox chunks this rank posted to each peer
        self._recvd = [0] * n    # mailbox chunks this rank consumed from each peer
        self._flag_me = arena.flag_i[self.rank]
        self._ranks = list(range(n))
        self._verify = _env.fingerprint_checks()
        self._peer_hdr = [[self._hdr_i[r][b] for r in arena.peers] for b in (0, 1)]
        self._entered_i = arena.ctrl(self.rank, C_ENTERED)
        self._done_i = arena.ctrl(self.rank, C_DONE)
        base = arena.u8.data_ptr()
        self._slot_addr = [[base + lay.slot_data_off(r, b) for b in (0, 1)] for r in range(n)]
        self._fast: dict[tuple[torch.dtype, int], tuple[list[np.ndarray], list[np.ndarray], np.ndarray]] = {}
        self._scratch = np.empty(FAST_BYTES // 8, dtype=np.float64)
        self._scratch_addr = self._scratch.ctypes.data
        self._fast_ok = lay.slot_bytes >= FAST_BYTES
        # (dtype, op) pairs the small-message path serves: numpy dtypes, AVG on floats only.
        self._fast_combos = {(d, o) for d in _NP_DTYPES for o in _UFUNCS
                             if o != RedOpType.AVG or d.is_floating_point} if self._fast_ok else set()

    def _fast_views(self, dtype: torch.dtype, k: int) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """numpy views of the first ``k`` elements of every slot (buffer 0, buffer 1) and of the scratch.

        Cached per (dtype, k): training loops repeat the same sizes, and slicing costs ~0.3 us.
        """
        views = self._fast.get((dtype, k))
        if views is None:
            if len(self._fast) >= _FAST_CACHE_MAX:
                self._fast.clear()
            npdt = np.dtype(_NP_DTYPES[dtype])
            lay, mem = self.arena.layout, cast(Any, self.arena.memory)
            b0 = [np.frombuffer(mem, npdt, k, lay.slot_data_off(r, 0)) for r in self._ranks]
            b1 = [np.frombuffer(mem, npdt, k, lay.slot_data_off(r, 1)) for r in self._ranks]
            views = (b0, b1, self._scratch.view(npdt)[:k])
            self._fast[(dtype, k)] = views
        return views

    # -- round machinery -----------------------------------------------------------
    def _sync(self, s: int, fp: tuple[int, int, int], chunk: int, ctx: OpContext) -> None:
        """Publish round ``s`` with this rank's fingerprint, wait for all peers, check theirs."""
        q = self.q
        b = s & 1
        f0, f1, f2 = fp
        h = self._hdr_i[self.rank][b]
        q[h + 1] = f0
        q[h + 2] = f1
        q[h + 3] = f2
        q[h + 4] = chunk
        q[h] = s
        q[self._flag_me] = s
        self.arena.wait_all_step(s, ctx)
        if self._verify:
            for hr in self._peer_hdr[b]:
                if q[hr + 1] != f0 or q[hr + 2] != f1 or q[hr + 3] != f2 or q[hr + 4] != chunk:
                    raise self._mismatch(s, ctx)
        self.step = s

    def _mismatch(self, s: int, ctx: OpContext) -> DistBackendError:
        q = self.q
        calls = []
        for r in self._ranks:
            h = self._hdr_i[r][s & 1]
            calls.append(f"rank {r}: {describe_fingerprint((q[h + 1], q[h + 2], q[h + 3]))} (chunk {q[h + 4]})")
        return ctx.error(CollectiveMismatchError,
                         "ranks called different collectives: " + "; ".join(calls), calls=calls)

    def _enter(self, ctx: OpContext) -> None:
        self.q[self._entered_i] = ctx.seq

    def _done(self, ctx: OpContext) -> None:
        self.q[self._done_i] = ctx.seq

    def _cap(self, dtype: torch.dtype) -> int:
        return self.arena.layout.slot_bytes // dtype.itemsize

    # -- collectives -----------------------------------------------------------------
    def all_reduce(self, buf: torch.Tensor, op: RedOpType, factor: float | None, ctx: OpContext) -> None:
        self._reduce_common(buf, op, factor, None, ctx)

    def reduce(self, buf: torch.Tensor, op: RedOpType, factor: float | None, root: int,
               ctx: OpContext) -> None:
        self._reduce_common(buf, op, factor, root, ctx)

    def _reduce_common(self, buf: torch.Tensor, op: RedOpType, factor: float | None,
                       root: int | None, ctx: OpContext) -> None:
        n, me, a = self.world_size, self.rank, self.arena
        if n == 1:
            if op == RedOpType.PREMUL_SUM:
                buf.mul_(1.0 if factor is None else factor)
            return
        dt = buf.dtype
        self.q[self._entered_i] = ctx.seq
        k = buf.numel()
        nbytes = k * dt.itemsize
        if nbytes <= FAST_BYTES and (dt, op) in self._fast_combos:
            self._small_reduce(buf, op, root, ctx, k, nbytes)
            self.q[self._done_i] = ctx.seq
            return
        flat = buf.view(-1)
        fp = ctx.fingerprint()
        whole = flat.numel()
        # With two ranks every op is commutative, so each rank may fold the peer's slot into its
        # own tensor in place (one read less per element); beyond two, all reduce in rank order.
        in_place = n == 2 and op != RedOpType.PREMUL_SUM
        for k, off, c in _chunks(whole, self._cap(dt)):
            s = self.step + 1
            b = s & 1
            piece = flat if c == whole else flat[off:off + c]
            prepare_contribution(piece, a.slot(me, b, dt)[:c], op, factor)
            self._sync(s, fp, k, ctx)
            if root is None or root == me:
                if in_place:
                    combine_(piece, [piece, a.slot(1 - me, b, dt)[:c]], op)
                else:
                    combine_(piece, [a.slot(r, b, dt)[:c] for r in self._ranks], op)
                finish_(piece, op, n)
        self._done(ctx)

    def _small_reduce(self, buf: torch.Tensor, op: RedOpType, root: int | None, ctx: OpContext,
                      k: int, nbytes: int) -> None:
        """One round: memmove in, flag, numpy reduce in rank order into scratch, memmove out."""
        s = self.step + 1
        b = s & 1
        ptr = buf.data_ptr()
        _memmove(self._slot_addr[self.rank][b], ptr, nbytes)
        self._sync(s, ctx.fingerprint(), 0, ctx)
        if root is not None and root != self.rank:
            return
        views = self._fast.get((buf.dtype, k)) or self._fast_views(buf.dtype, k)
        slots = views[b]
        out = views[2]
        ufunc = _UFUNCS[op]
        token = _quiet()    # overflow to inf is a result, as in torch, not a warning
        try:
            ufunc(slots[0], slots[1], out=out)
            for r in range(2, self.world_size):
                ufunc(out, slots[r], out=out)
            if op == RedOpType.AVG:
                np.divide(out, self.world_size, out=out)
        finally:
            _loud(token)
        _memmove(ptr, self._scratch_addr, nbytes)

    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext) -> None:
        if self.world_size == 1:
            return
        me, a = self.rank, self.arena
        self._enter(ctx)
        fp = ctx.fingerprint()
        nbytes = buf.numel() * buf.element_size()
        if nbytes <= FAST_BYTES and self._fast_ok:
            s = self.step + 1
            if me == root:
                _memmove(self._slot_addr[me][s & 1], buf.data_ptr(), nbytes)
            self._sync(s, fp, 0, ctx)
            if me != root:
                _memmove(buf.data_ptr(), self._slot_addr[root][s & 1], nbytes)
            self._done(ctx)
            return
        flat = buf.view(-1)
        dt = flat.dtype
        for k, off, c in _chunks(flat.numel(), self._cap(dt)):
            s = self.step + 1
            b = s & 1
            if me == root:
                a.slot(me, b, dt)[:c].copy_(flat[off:off + c])
            self._sync(s, fp, k, ctx)
            if me != root:
                flat[off:off + c].copy_(a.slot(root, b, dt)[:c])
        self._done(ctx)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext) -> None:
        self._gather_common(inp, out, None, ctx)

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext) -> None:
        self._gather_common(inp, out, root, ctx)

    def _gather_common(self, inp: torch.Tensor, out: torch.Tensor | None, root: int | None,
                       ctx: OpContext) -> None:
        fi = inp.view(-1)
        fo = out.view(-1) if out is not None else None
        n, me, a = self.world_size, self.rank, self.arena
        N = fi.numel()
        if n == 1:
            if fo is not None:
                fo.copy_(fi)
            return
        self._enter(ctx)
        fp = ctx.fingerprint()
        dt = fi.dtype
        nbytes = N * fi.element_size()
        if nbytes <= FAST_BYTES and self._fast_ok:
            self._small_gather(fi, fo, nbytes, ctx)
            self._done(ctx)
            return
        for k, off, c in _chunks(N, self._cap(dt)):
            s = self.step + 1
            b = s & 1
            a.slot(me, b, dt)[:c].copy_(fi[off:off + c])
            self._sync(s, fp, k, ctx)
            if fo is not None:
                for r in self._ranks:
                    src = fi[off:off + c] if r == me else a.slot(r, b, dt)[:c]
                    dst = fo[r * N + off:r * N + off + c]
                    if dst.data_ptr() != src.data_ptr():     # the input may be its own block of out
                        dst.copy_(src)
        self._done(ctx)

    def _small_gather(self, fi: torch.Tensor, fo: torch.Tensor | None, nbytes: int, ctx: OpContext) -> None:
        s = self.step + 1
        b = s & 1
        src = fi.data_ptr()
        _memmove(self._slot_addr[self.rank][b], src, nbytes)
        self._sync(s, ctx.fingerprint(), 0, ctx)
        if fo is not None:
            dst = fo.data_ptr()
            for r in self._ranks:
                _memmove(dst + r * nbytes, src if r == self.rank else self._slot_addr[r][b], nbytes)

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext) -> None:
        fo = out.view(-1)
        fi = inp.view(-1) if inp is not None else None
        n, me, a = self.world_size, self.rank, self.arena
        N = fo.numel()
        if n == 1:
            if fi is not None:
                fo.copy_(fi)
            return
        self._enter(ctx)
        fp = ctx.fingerprint()
        dt = fo.dtype
        sub = self._cap(dt) // n
        for k, off, c in _chunks(N, sub):
            s = self.step + 1
            b = s & 1
            if fi is not None:
                mine = a.slot(me, b, dt)
                for r in self._ranks:
                    mine[r * sub:r * sub + c].copy_(fi[r * N + off:r * N + off + c])
            self._sync(s, fp, k, ctx)
            fo[off:off + c].copy_(a.slot(root, b, dt)[me * sub:me * sub + c])
        self._done(ctx)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: RedOpType,
                       factor: float | None, ctx: OpContext) -> None:
        fo, fi = out.view(-1), inp.view(-1)
        n, me, a = self.world_size, self.rank, self.arena
        N = fo.numel()
        if n == 1:
            prepare_contribution(fi, fo, op, factor)
            return
        self._enter(ctx)
        fp = ctx.fingerprint()
        dt = fo.dtype
        nbytes = N * fo.element_size()
        if (self._fast_ok and nbytes * n <= FAST_BYTES and dt in _NP_DTYPES and op in _UFUNCS
                and (op != RedOpType.AVG or dt.is_floating_point)):
            self._small_reduce_scatter(fi, fo, op, nbytes, ctx)
            self._done(ctx)
            return
        sub = self._cap(dt) // n
        # Only this rank reads its own block: fold it from the input instead of a copy in the
        # arena when that copy would be exact and folding cannot overwrite it before it is read.
        own_direct = op != RedOpType.PREMUL_SUM and _foldable_in_place(fi, fo, me, n, N)
        for k, off, c in _chunks(N, sub):
            s = self.step + 1
            b = s & 1
            mine = a.slot(me, b, dt)
            for r in self._ranks:
                if r != me or not own_direct:
                    prepare_contribution(fi[r * N + off:r * N + off + c], mine[r * sub:r * sub + c], op, factor)
            self._sync(s, fp, k, ctx)
            piece = fo[off:off + c]
            parts = [a.slot(r, b, dt)[me * sub:me * sub + c] for r in self._ranks]
            if own_direct:
                parts[me] = fi[me * N + off:me * N + off + c]
            combine_(piece, parts, op)
            finish_(piece, op, n)
        self._done(ctx)

    def _small_reduce_scatter(self, fi: torch.Tensor, fo: torch.Tensor, op: RedOpType, nbytes: int,
                              ctx: OpContext) -> None:
        """Whole input into this rank's slot in one memmove; reduce block ``rank`` of every slot."""
        n, me = self.world_size, self.rank
        s = self.step + 1
        b = s & 1
        _memmove(self._slot_addr[me][b], fi.data_ptr(), nbytes * n)
        self._sync(s, ctx.fingerprint(), 0, ctx)
        k = fo.numel()
        key = (fo.dtype, -k)          # negative k: the block-``rank`` views of reduce_scatter
        views = self._fast.get(key)
        if views is None:
            if len(self._fast) >= _FAST_CACHE_MAX:
                self._fast.clear()
            npdt = np.dtype(_NP_DTYPES[fo.dtype])
            lay, mem = self.arena.layout, cast(Any, self.arena.memory)
            b0 = [np.frombuffer(mem, npdt, k, lay.slot_data_off(r, 0) + me * nbytes) for r in self._ranks]
            b1 = [np.frombuffer(mem, npdt, k, lay.slot_data_off(r, 1) + me * nbytes) for r in self._ranks]
            views = self._fast[key] = (b0, b1, self._scratch.view(npdt)[:k])
        slots = views[1] if b else views[0]
        out = views[2]
        ufunc = _UFUNCS[op]
        token = _quiet()
        try:
            ufunc(slots[0], slots[1], out=out)
            for r in range(2, n):
                ufunc(out, slots[r], out=out)
            if op == RedOpType.AVG:
                np.divide(out, n, out=out)
        finally:
            _loud(token)
        _memmove(fo.data_ptr(), self._scratch_addr, nbytes)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext) -> None:
        n, me, a = self.world_size, self.rank, self.arena
        fi, fo = inp.view(-1), out.view(-1)
        if n == 1:
            fo.copy_(fi)
            return
        self._enter(ctx)
        fp = ctx.fingerprint()
        # Round 0: every rank publishes its split table; all check that rank r sends to j
        # exactly what j expects from r, so bytes are never misread.
        s = self.step + 1
        table = a.slot(me, s & 1, torch.int64)
        table[:2 * n].copy_(torch.tensor(list(in_splits) + list(out_splits), dtype=torch.int64))
        self._sync(s, fp, 0, ctx)
        sends = [a.slot(r, s & 1, torch.int64)[:n].tolist() for r in self._ranks]
        for r in self._ranks:
            expect = a.slot(r, s & 1, torch.int64)[n:2 * n].tolist()
            for j in self._ranks:
                if sends[j][r] != expect[j]:
                    raise ctx.error(CollectiveMismatchError,
                                    f"all_to_all split sizes disagree: rank {j} sends {sends[j][r]} bytes "
                                    f"to rank {r}, which expects {expect[j]}")
        in_off = [sum(in_splits[:j]) for j in range(n)]
        out_off = [sum(out_splits[:j]) for j in range(n)]
        sub = (a.layout.slot_bytes // n) // 64 * 64
        biggest = max(max(row) for row in sends)
        rounds = max(1, -(-biggest // sub))
        for k in range(rounds):
            s = self.step + 1
            b = s & 1
            mine = a.slot(me, b, torch.uint8)
            for j in self._ranks:
                lo = min(k * sub, in_splits[j])
                c = min(sub, in_splits[j] - lo)
                if c > 0:
                    mine[j * sub:j * sub + c].copy_(fi[in_off[j] + lo:in_off[j] + lo + c])
            self._sync(s, fp, k + 1, ctx)
            for r in self._ranks:
                lo = min(k * sub, out_splits[r])
                c = min(sub, out_splits[r] - lo)
                if c > 0:
                    fo[out_off[r] + lo:out_off[r] + lo + c].copy_(a.slot(r, b, torch.uint8)[me * sub:me * sub + c])
        self._done(ctx)

    def barrier(self, ctx: OpContext) -> None:
        if self.world_size == 1:
            return
        self._enter(ctx)
        self._sync(self.step + 1, ctx.fingerprint(), 0, ctx)
        self._done(ctx)

    # -- point to point --------------------------------------------------------------
    def _pair_i(self, src: int, dst: int) -> tuple[int, int]:
        off = self.arena.layout.pair_off(src, dst) // 8
        return off, off + 8   # (sent counter written by src, acked counter written by dst)

    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        a, q = self.arena, self.q
        data = buf.reshape(-1).view(torch.uint8)
        nbytes = data.numel()
        sent_i, acked_i = self._pair_i(self.rank, dst)
        for k, off, c in _chunks(nbytes, a.layout.p2p_bytes):
            m = self._sent[dst] + 1
            b = m & 1
            a.wait_ge([acked_i], [dst], m - 2, ctx)
            a.mailbox(self.rank, dst, b)[:c].copy_(data[off:off + c])
            h = a.layout.mailbox_hdr_off(self.rank, dst, b) // 8
            q[h + 1], q[h + 2], q[h + 3], q[h + 4], q[h + 5] = tag, nbytes, k, c, ctx.seq
            q[h] = m
            q[sent_i] = m
            self._sent[dst] = m

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        a, q = self.arena, self.q
        if src is None:
            src = self._wait_any_source(ctx)
        data = buf.reshape(-1).view(torch.uint8)
        nbytes = data.numel()
        sent_i, acked_i = self._pair_i(src, self.rank)
        for k, off, c in _chunks(nbytes, a.layout.p2p_bytes):
            m = self._recvd[src] + 1
            b = m & 1
            a.wait_ge([sent_i], [src], m, ctx)
            h = a.layout.mailbox_hdr_off(src, self.rank, b) // 8
            got = (q[h + 1], q[h + 2], q[h + 3], q[h + 4])
            if got != (tag, nbytes, k, c):
                raise ctx.error(CollectiveMismatchError,
                                f"rank {src} sent a message of {got[1]} bytes with tag {got[0]}, but rank "
                                f"{self.rank} expected {nbytes} bytes with tag {tag}", peer=src)
            data[off:off + c].copy_(a.mailbox(src, self.rank, b)[:c])
            q[acked_i] = m
            self._recvd[src] = m
        return src

    def pending_source(self) -> int | None:
        """The lowest rank with a message chunk this rank has not consumed yet (no waiting)."""
        q = self.q
        for r in self.arena.peers:
            if q[self._pair_i(r, self.rank)[0]] > self._recvd[r]:
                return r
        return None

    def _wait_any_source(self, ctx: OpContext) -> int:
        peers = self.arena.peers
        idx = [self._pair_i(r, self.rank)[0] for r in peers]
        k = self.arena.wait_any_gt(idx, peers, [self._recvd[r] for r in peers], ctx)
        return peers[k]

    # -- lifecycle -------------------------------------------------------------------
    def wait_stats(self) -> tuple[float, dict[int, float]]:
        return self.arena.wait_s, dict(self.arena.late_s)

    def abort(self, reason: str) -> None:
        self.arena.abort(reason)

    def mark_departed(self) -> None:
        self.q[self.arena.ctrl(self.rank, C_DEPARTED)] = 1

    def peer_id(self, rank: int) -> int:
        return self.q[self.arena.ctrl(rank, C_PID)]


# SLOT_HDR is re-exported for backings that lay out extra headers.
_ = SLOT_HDR
