"""``auto`` across hosts: shared memory among the ranks of each host, tcp among hosts.

A group whose ranks span several hosts (``w.hosts``: hostname + network namespace +
boot id) gets one ``shm`` transport per host (its local ranks) and one ``tcp``
transport over all ranks.  Large ``all_reduce``, ``reduce_scatter`` and ``all_gather`` are
hierarchical; point-to-point messages between ranks of one host go through its shared
memory; everything else runs on the flat tcp transport, which is correct for any layout.
The two are composed through the :class:`~ringlet.transport.base.Transport` interface only:
any ``local`` transport, and any ``net`` transport that runs collectives over rank subsets
([Note: rank subsets]).

[Note: hierarchical reduction order]
Results must be bit-identical to the flat tcp path of the same group.  A group that spans
hosts folds in host-major order ([Note: tcp reduction order]): each host's contributions in
rank order, then the hosts' partial results in host order.  That is exactly what the
hierarchical all-reduce computes, with every host working at once:

1. host reduce-scatter (shm): block ``l`` of the host's partial result lands on local rank ``l``;
2. all-reduce of block ``l`` among the ranks with local rank ``l`` on every host (a tcp
   "column", folded in host order);
3. host all-gather (shm).

The steps are stages of the one reduction ([Note: reductions]): the host steps scale each
contribution (PREMUL_SUM) and fold without dividing (``partial``); the column step folds the
hosts' partial results and divides once (``completing``: AVG by the whole group's size), as the
flat path does.  Every host needs the same number of ranks (any numbering); other layouts, and
tensors of ``FLAT_BYTES`` or less (one direct exchange beats three steps), use the flat path.
Inter-host bytes: about one tensor each way per host, in parallel over the columns, against
``2(n-1)/n`` tensors per *rank* for the flat path's reduce-scatter + all-gather.
"""

from __future__ import annotations

import concurrent.futures
import copy
import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from ringlet.errors import CollectiveTimeoutError, DistBackendError
from ringlet.store import PrefixStore
from ringlet.transport.arena import usable_cpus
from ringlet.transport.base import OpContext, Ranks, ReduceArg, Transport, whole_group
from ringlet.transport.reduce import Reduction, reduction
from ringlet.transport.shm import ShmTransport
from ringlet.transport.tcp import TcpTransport

__all__ = ["HierarchicalTransport", "HostPlan", "plan_hosts", "same_kernel"]

# Tensors up to this many bytes take the flat path: the flat transport's one direct exchange
# beats three steps (the tcp transport's own direct all-reduce goes up to the same size).
FLAT_BYTES = 64 * 1024
# Shared-memory steps get this much longer than the operation's deadline: when a rank waits on
# the network, its host-mates wait on it; letting it time out first means they fail with its
# reason (which names the remote rank and host) instead of a timeout that names a host-mate.
LOCAL_GRACE_S = 0.5
# Large all-reduces run in segments of about this many bytes, so that the columns' network
# transfer of one segment overlaps the shared-memory steps of its neighbours -- when there are
# CPUs to spare for that.  Where the job's ranks on this kernel outnumber its CPUs (simulated
# hosts on one machine), every step competes for the same cores and the overlap only adds
# hand-offs and waits: measured there, 16 MiB took 45-51 ms in 4 MiB segments, 37-39 ms in one.
SEGMENT_BYTES = 4 << 20
# reduce_scatter inputs up to this many bytes take the flat path (one step beats two).  Above it
# the hierarchical one sends 1/L of the flat path's bytes between hosts; measured on 2 simulated
# hosts x 2 ranks (bench/collectives.py --hosts 2 --ranks 2 --ops reduce_scatter_tensor): with
# 1 Gbit/s links 2.0x flat at 1 MiB and 1.65x at 16 MiB; with unlimited links (the "network" a
# memory copy on the same two cores) 1.14x at 1 MiB but 0.89x at 16 MiB, where its extra
# shared-memory pass costs more than the network bytes it saves.
HIER_REDUCE_SCATTER_MIN = 256 << 10


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """Where every rank of a group lives; pure data, built by :func:`plan_hosts`."""

    hosts: tuple[tuple[int, ...], ...]   # group ranks of each host, hosts ordered by lowest rank
    host: int                            # this rank's host index
    local: int                           # this rank's index on its host

    @property
    def uniform(self) -> bool:
        return len({len(h) for h in self.hosts}) == 1

    @property
    def contiguous(self) -> bool:
        flat = [r for h in self.hosts for r in h]
        return flat == list(range(len(flat)))

    @property
    def leaders(self) -> list[int]:
        return [h[0] for h in self.hosts]

    def column(self, local: int) -> list[int]:
        """The ranks with local index ``local`` on every host, in host order."""
        return [h[local] for h in self.hosts]


def _bind(fn: Callable[..., None], *args: Any) -> Callable[[OpContext], None]:
    """``ctx -> fn(*args, ctx)``: a shared-memory step for ``HierarchicalTransport._shm``."""
    return lambda ctx: fn(*args, ctx)


def same_kernel(host_keys: list[str], rank: int) -> int:
    """How many ranks share ``rank``'s kernel, hence its CPUs: simulated hosts (network namespaces)
    differ in their host keys but not in the boot id that ends them (``rendezvous.host_key``).

    Example::

        >>> same_kernel(["a/1/b00t", "a/1/b00t", "a/2/b00t", "c/1/0ther"], 0)
        3
    """
    def kernel(key: str) -> str:
        boot = key.rsplit("/", 1)[-1]
        return key if boot in ("", "?") else boot

    mine = kernel(host_keys[rank])
    return sum(kernel(k) == mine for k in host_keys)


def plan_hosts(host_keys: list[str], rank: int) -> HostPlan:
    """Group ranks by host key.

    Example::

        >>> plan_hosts(["a", "a", "b", "b"], 2)
        HostPlan(hosts=((0, 1), (2, 3)), host=1, local=0)
    """
    order: dict[str, list[int]] = {}
    for r, key in enumerate(host_keys):
        order.setdefault(key, []).append(r)
    hosts = tuple(tuple(rs) for rs in order.values())
    host = next(i for i, h in enumerate(hosts) if rank in h)
    return HostPlan(hosts, host, hosts[host].index(rank))


class HierarchicalTransport(Transport):
    """shm within hosts + tcp among them (see the module docstring)."""

    name = "shm+tcp"

    def __init__(self, rank: int, plan: HostPlan, local: Transport, net: Transport) -> None:
        if not net.subsets:
            raise ValueError(f"hierarchical transport: expected a network transport that runs "
                             f"collectives over rank subsets, got {type(net).__name__}")
        self.rank = rank
        self.world_size = net.world_size
        self.plan = plan
        self.local = local        # this host's ranks, numbered locally
        self.net = net            # every rank of the group
        self._columns: concurrent.futures.ThreadPoolExecutor | None = None  # the columns' steps
        self.pipelined = True     # segments overlap network and shared memory (see SEGMENT_BYTES)

    @classmethod
    def create(cls, store: Any, rank: int, host_keys: list[str], timeout: float,
               group: str) -> HierarchicalTransport:
        """Build this host's shm arena and the tcp mesh; every rank of the group calls this."""
        plan = plan_hosts(host_keys, rank)
        mates = plan.hosts[plan.host]
        local = ShmTransport.create(PrefixStore(f"host{plan.host}", store), plan.local, len(mates),
                                    timeout, f"{group}/host{plan.host}")
        try:
            net = TcpTransport.create(PrefixStore("net", store), rank, len(host_keys), timeout,
                                      group, host_keys=host_keys)
        except BaseException:
            local.close()
            raise
        busy = same_kernel(host_keys, rank)
        local.share_cpus(busy)
        tr = cls(rank, plan, local, net)
        tr.pipelined = busy <= usable_cpus()
        return tr

    def __repr__(self) -> str:
        return (f"HierarchicalTransport(rank {self.rank}/{self.world_size}, "
                f"hosts {list(self.plan.hosts)})")

    def _shm(self, ctx: OpContext, call: Callable[[OpContext], object]) -> None:
        """Run one shared-memory step (see LOCAL_GRACE_S); its errors say how it numbers ranks."""
        lctx = copy.copy(ctx)
        lctx.deadline = ctx.deadline + LOCAL_GRACE_S
        try:
            call(lctx)
        except DistBackendError as e:
            here = self.plan.hosts[self.plan.host]
            mates = ", ".join(f"{i} = rank {r}" for i, r in enumerate(here))
            raise type(e)(f"{e} [shared memory on this host numbers its ranks locally: {mates}]",
                          **e.context) from None

    # -- hierarchical collectives ------------------------------------------------------------
    def _guarded(self, fn: Callable[[], None], ranks: Ranks) -> None:
        """On failure abort both transports at once: host-mates waiting in shared memory and peers
        waiting on tcp learn the cause now (it names the remote rank), not at their own deadline."""
        whole_group(self, ranks)
        try:
            fn()
        except DistBackendError as e:
            self.abort(f"{type(e).__name__}: {e}")
            raise

    def all_reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        self._guarded(lambda: self._all_reduce(buf, op, factor, ctx), ranks)

    def _all_reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None,
                    ctx: OpContext) -> None:
        flat, p = buf.view(-1), self.plan
        small = flat.numel() * flat.element_size() <= FLAT_BYTES or flat.numel() < len(p.hosts[0])
        if small or not p.uniform:
            self.net.all_reduce(buf, op, factor, ctx)
            return
        L = len(p.hosts[0])
        red = reduction(op, factor, flat.dtype, self.world_size)
        padded, _ = self._padded(flat, L)
        out = padded if padded is flat else torch.empty_like(padded)
        if not self.pipelined:
            B = padded.numel() // L
            mine = out[p.local * B:(p.local + 1) * B]
            self._shm(ctx, _bind(self.local.reduce_scatter, padded, mine, red.partial(), None))
            self._column(mine, red, ctx)
            self._shm(ctx, lambda cc: self.local.all_gather(mine, out, cc))
            if out is not flat:
                flat.copy_(out[:flat.numel()])
            return
        seg = max(L, SEGMENT_BYTES // flat.element_size() // L * L)
        segments = [(o, min(seg, padded.numel() - o)) for o in range(0, padded.numel(), seg)]
        if self._columns is None:
            self._columns = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="ringlet-columns")
        pending: list[tuple[concurrent.futures.Future[None], torch.Tensor, int, int]] = []
        try:
            for o, c in segments:      # segment k's shm steps overlap segment k-1's network step
                # This rank's block of the segment is reduced straight into its place in ``out``
                # (which may be the input: the shm reduce-scatter folds that block in place), goes
                # through the column there, and the host all-gather leaves it where it is.
                B = c // L
                mine = out[o + p.local * B:o + (p.local + 1) * B]
                piece = padded[o:o + c]
                self._shm(ctx, _bind(self.local.reduce_scatter, piece, mine, red.partial(), None))
                pending.append((self._columns.submit(self._column, mine, red, ctx), mine, o, c))
                if len(pending) > 1:
                    self._gather_segment(pending.pop(0), out, ctx)
            while pending:
                self._gather_segment(pending.pop(0), out, ctx)
        finally:
            if pending:                # failed half-way: stop the network step before leaving
                self.net.abort("hierarchical all_reduce failed")
                concurrent.futures.wait([f for f, *_ in pending], timeout=5.0)
        if out is not flat:
            flat.copy_(out[:flat.numel()])

    def _column(self, mine: torch.Tensor, red: Reduction, ctx: OpContext) -> None:
        """Block ``local`` of the hosts' partial results, folded in host order and finished."""
        p = self.plan
        self.net.all_reduce(mine, red.completing(), None, ctx, ranks=p.column(p.local))

    def _gather_segment(self, item: tuple[concurrent.futures.Future[None], torch.Tensor, int, int],
                        out: torch.Tensor, ctx: OpContext) -> None:
        fut, mine, o, c = item
        fut.result(timeout=max(ctx.deadline - time.monotonic(), 0.0) + LOCAL_GRACE_S + 5.0)
        self._shm(ctx, lambda cc: self.local.all_gather(mine, out[o:o + c], cc))

    def _padded(self, flat: torch.Tensor, L: int) -> tuple[torch.Tensor, int]:
        """``flat`` padded with zeros to ``L`` equal blocks (itself when it divides), block size."""
        B = -(-flat.numel() // L)
        if B * L == flat.numel():
            return flat, B
        out = torch.zeros(B * L, dtype=flat.dtype)
        out[:flat.numel()].copy_(flat)
        return out, B

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReduceArg,
                       factor: float | None, ctx: OpContext, ranks: Ranks = None) -> None:
        self._guarded(lambda: self._reduce_scatter(inp, out, op, factor, ctx), ranks)

    def _reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReduceArg,
                        factor: float | None, ctx: OpContext) -> None:
        """Each host reduce-scatters so that local rank ``l`` holds the host's sums of the blocks
        of every rank with local index ``l``; then each column reduce-scatters those over tcp.
        Host-major fold order, as the flat path ([Note: hierarchical reduction order]); the
        network carries ``1/L`` of what the flat reduce-scatter sends."""
        p = self.plan
        fi, fo = inp.view(-1), out.view(-1)
        if not p.uniform or fi.numel() * fi.element_size() <= HIER_REDUCE_SCATTER_MIN:
            self.net.reduce_scatter(inp, out, op, factor, ctx)
            return
        H, L, N = len(p.hosts), len(p.hosts[0]), fo.numel()
        red = reduction(op, factor, fo.dtype, self.world_size)
        grid = torch.empty(L * H * N, dtype=fi.dtype)      # blocks local-index-major
        g, blocks = grid.view(L, H, N), fi.view(self.world_size, N)
        if p.contiguous:
            g.copy_(blocks.view(H, L, N).transpose(0, 1))
        else:
            for h, ranks in enumerate(p.hosts):
                for loc, r in enumerate(ranks):
                    g[loc, h].copy_(blocks[r])
        mine = torch.empty(H * N, dtype=fi.dtype)
        self._shm(ctx, _bind(self.local.reduce_scatter, grid, mine, red.partial(), None))
        self.net.reduce_scatter(mine, fo, red.completing(), None, ctx, ranks=p.column(p.local))

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        self._guarded(lambda: self._all_gather(inp, out, ctx), ranks)

    def _all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext) -> None:
        """Each column gathers over tcp, then each host gathers the columns over shm."""
        p = self.plan
        if not p.uniform or out.numel() * out.element_size() <= FLAT_BYTES:
            self.net.all_gather(inp, out, ctx)
            return
        H, L, N = len(p.hosts), len(p.hosts[0]), inp.numel()
        col = torch.empty(H * N, dtype=inp.dtype)
        self.net.all_gather(inp.view(-1), col, ctx, ranks=p.column(p.local))
        grid = torch.empty(L * H * N, dtype=inp.dtype)
        self._shm(ctx, lambda c: self.local.all_gather(col, grid, c))
        fo, g = out.view(-1), grid.view(L, H, N)
        if p.contiguous:
            fo.view(H, L, N).copy_(g.transpose(0, 1))
            return
        for h, ranks in enumerate(p.hosts):
            for loc, r in enumerate(ranks):
                fo[r * N:(r + 1) * N].copy_(g[loc, h])

    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext, ranks: Ranks = None) -> None:
        self._guarded(lambda: self._broadcast(buf, root, ctx), ranks)

    def _broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext) -> None:
        """The root sends to one rank per other host (tcp); each host broadcasts (shm)."""
        p = self.plan
        rh = next(i for i, h in enumerate(p.hosts) if root in h)
        chain = [root] + [h[0] for i, h in enumerate(p.hosts) if i != rh]
        if self.rank in chain:
            self.net.broadcast(buf.view(-1), 0, ctx, ranks=chain)
        src = p.hosts[rh].index(root) if p.host == rh else 0
        self._shm(ctx, lambda c: self.local.broadcast(buf, src, c))

    # -- flat: the network transport over the whole group ----------------------------------------
    def reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, root: int,
               ctx: OpContext, ranks: Ranks = None) -> None:
        whole_group(self, ranks)
        self.net.reduce(buf, op, factor, root, ctx)

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: Ranks = None) -> None:
        whole_group(self, ranks)
        self.net.gather(inp, out, root, ctx)

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: Ranks = None) -> None:
        whole_group(self, ranks)
        self.net.scatter(inp, out, root, ctx)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext, ranks: Ranks = None) -> None:
        whole_group(self, ranks)
        self.net.all_to_all(inp, in_splits, out, out_splits, ctx)

    def barrier(self, ctx: OpContext, ranks: Ranks = None) -> None:
        whole_group(self, ranks)
        self.net.barrier(ctx)

    # -- point to point: shared memory to a host-mate, tcp to other hosts -----------------------
    def _mate(self, r: int) -> int | None:
        """``r``'s index on this host's shared memory, or None when it lives elsewhere."""
        mates = self.plan.hosts[self.plan.host]
        return mates.index(r) if r in mates else None

    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        li = self._mate(dst)
        if li is None:
            self.net.send(buf, dst, tag, ctx)
        else:
            self._shm(ctx, lambda c: self.local.send(buf, li, tag, c))

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        if src is None:
            src = self._any_source(ctx)
        li = self._mate(src)
        if li is None:
            return self.net.recv(buf, src, tag, ctx)
        self._shm(ctx, lambda c: self.local.recv(buf, li, tag, c))
        return src

    def _any_source(self, ctx: OpContext) -> int:
        """The lowest rank whose message is here, watching shared memory and tcp at once (polling
        both: they have no wake-up in common)."""
        mates = self.plan.hosts[self.plan.host]
        self.net.watch_any_source(+1)
        try:
            delay = 2e-5
            while True:
                li = self.local.pending_source()
                if li is not None:
                    return mates[li]
                r = self.net.pending_source()
                if r is not None:
                    return r
                self.net.check_any_source(ctx)     # aborted, destroyed, or nobody left to send
                remaining = ctx.deadline - time.monotonic()
                if remaining <= 0:
                    others = [r for r in range(self.world_size) if r != self.rank]
                    raise ctx.error(CollectiveTimeoutError, f"timed out waiting for a message from "
                                    f"any of ranks {others} (shared memory and tcp)",
                                    missing=others)
                time.sleep(min(delay, remaining))
                delay = min(delay * 2, 1e-3)
        finally:
            self.net.watch_any_source(-1)

    # -- lifecycle -----------------------------------------------------------------------------
    def wait_stats(self) -> tuple[float, dict[int, float]]:
        return self.net.wait_stats()

    def abort(self, reason: str) -> None:
        self.local.abort(reason)
        self.net.abort(reason)

    def close(self) -> None:
        try:
            self.local.close()
        finally:
            self.net.close()
            if self._columns is not None:
                self._columns.shutdown(wait=True, cancel_futures=True)
