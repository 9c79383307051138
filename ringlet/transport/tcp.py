"""The ``tcp`` transport: ranks anywhere, one authenticated connection per pair of ranks.

How it fits together:

- ``_tcp_wire``: frame headers and the token handshake ([Note: tcp frames],
  [Note: tcp handshake]); which address to listen on.
- ``_tcp_mesh``: listen on port 0, publish ``host:port`` in the group's store, connect.
- ``_tcp_pump``: non-blocking, deadline-bounded movement of frames for one operation.
- ``_tcp_algos``: the reducing collectives ([Note: tcp reduction order]); ``_tcp_moves``: the
  data-movement ones.

- ``_tcp_link``: the reader thread that routes every incoming frame to its owner
  ([Note: tcp routing]) and the per-connection send locks.

This module holds the transport object: collectives delegate to the algorithms,
point-to-point messages travel on the same connection (one P2P frame per message,
ordered, checked against the receiver's tag and size before the payload is read),
and ``abort``/``close`` tell the peers (ABORT and BYE frames) so that they fail at
once instead of at their deadline.

Example (what ``init_process_group(backend="tcp")`` does for each group)::

    transport = TcpTransport.create(group_store, rank, world_size, timeout=300.0, group="default_pg")
    transport.all_reduce(t, RedOpType.SUM, None, ctx)
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from ringlet import _env
from ringlet.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistBackendError,
    GroupAbortedError,
)
from ringlet.transport._tcp_algos import TcpAlgos, mv
from ringlet.transport._tcp_link import Want
from ringlet.transport._tcp_mesh import Peer, build_mesh
from ringlet.transport._tcp_pump import Pump, peer_lost
from ringlet.transport._tcp_wire import (
    ABORT,
    BYE,
    HEADER,
    MAX_REASON,
    P2P,
    header,
    interface_address,
    parse_header,
    route_source,
)
from ringlet.transport.base import OpContext, Transport
from ringlet.transport.reduce import RedOpType

__all__ = ["TcpTransport", "choose_address"]


def choose_address(store: Any, single_host: bool = False) -> str:
    """The address this rank listens on: ``RINGLET_IFNAME``'s, else the one it reaches the
    store's host (or ``MASTER_ADDR``) from, else loopback on one host or the hostname's address."""
    name = _env.ifname()
    if name:
        return interface_address(name)
    master = _store_host(store) or os.environ.get("MASTER_ADDR")
    if master:
        src = route_source(master)
        if src:
            return src
    if single_host:
        return "127.0.0.1"
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _store_host(store: Any) -> str | None:
    for _ in range(16):      # PrefixStore chains are short; bounded anyway
        host = getattr(store, "host", None)
        if isinstance(host, str) and host:
            return host
        store = getattr(store, "underlying_store", None)
        if store is None:
            return None
    return None


class TcpTransport(Transport):
    """Collectives and point-to-point over TCP connections (see the module docstring)."""

    name = "tcp"

    def __init__(self, rank: int, world_size: int, peers: dict[int, Peer], host: str,
                 host_keys: list[str] | None = None, group: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.peers = peers
        self.host = host
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.pump = Pump(rank, peers, self._wake_r, self._wake_w, f"ringlet-tcp-rx {group} r{rank}")
        self.pump.abort_hook = self._send_aborts
        self.algos = TcpAlgos(self.pump, rank, world_size, _env.tcp_chunk_bytes(), host_keys)
        self._p2p_tx = dict.fromkeys(peers, 0)
        self._p2p_rx = dict.fromkeys(peers, 0)
        self._rx_locks = {r: threading.Lock() for r in peers}
        self._aborts_sent = False
        self._closed = False

    @classmethod
    def create(cls, store: Any, rank: int, world_size: int, timeout: float, group: str,
               host: str | None = None, token: bytes | None = None,
               host_keys: list[str] | None = None) -> TcpTransport:
        """Connect to every rank of the group; every rank of the group calls this.

        Args:
            store: the group's store (already prefixed); addresses are published there.
            host: address to listen on (default: :func:`choose_address`).
            token: run token for the handshake (default ``RINGLET_STORE_TOKEN[_FILE]``).
            host_keys: each group rank's host (rendezvous ``host_key``): the fold order across
                hosts ([Note: tcp reduction order]); all equal means loopback will do.

        Raises:
            DistNetworkError: a peer is unreachable, refused this rank, or never connected.
            DistStoreError: a rank never published its address within ``timeout``.
        """
        single_host = host_keys is not None and len(set(host_keys)) == 1
        host = host or choose_address(store, single_host)
        token = _env.store_token() if token is None else token
        peers = build_mesh(store, rank, world_size, timeout, group, host, token)
        return cls(rank, world_size, peers, host, host_keys, group)

    def __repr__(self) -> str:
        return f"TcpTransport(rank {self.rank}/{self.world_size}, {self.host})"

    # -- collectives -------------------------------------------------------------------------
    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        """Run a collective; on failure abort at once (peers hear it now, not after our report)."""
        try:
            fn(*args)
        except DistBackendError as e:
            self.abort(f"{type(e).__name__}: {e}")
            raise

    def all_reduce(self, buf: torch.Tensor, op: RedOpType, factor: float | None, ctx: OpContext) -> None:
        self._call(self.algos.all_reduce, buf.view(-1), op, factor, ctx)

    def reduce(self, buf: torch.Tensor, op: RedOpType, factor: float | None, root: int,
               ctx: OpContext) -> None:
        self._call(self.algos.reduce, buf.view(-1), op, factor, root, ctx)

    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext) -> None:
        self._call(self.algos.broadcast, buf.view(-1), root, ctx)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext) -> None:
        self._call(self.algos.all_gather, inp.view(-1), out.view(-1), ctx)

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext) -> None:
        self._call(self.algos.gather, inp.view(-1), out.view(-1) if out is not None else None, root, ctx)

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext) -> None:
        self._call(self.algos.scatter, inp.view(-1) if inp is not None else None, out.view(-1), root, ctx)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: RedOpType,
                       factor: float | None, ctx: OpContext) -> None:
        self._call(self.algos.reduce_scatter, inp.view(-1), out.view(-1), op, factor, ctx)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext) -> None:
        self._call(self.algos.all_to_all, inp.view(-1), list(in_splits), out.view(-1), list(out_splits), ctx)

    def barrier(self, ctx: OpContext) -> None:
        self._call(self.algos.barrier, ctx)

    # -- point to point ----------------------------------------------------------------------
    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        p = self.peers[dst]
        data = mv(buf)
        idx = self._p2p_tx[dst]
        self._p2p_tx[dst] = idx + 1
        frame = [memoryview(header(P2P, tag, len(data), 0, idx & 0xFFFFFFFF, len(data))), data]

        def stopped() -> BaseException:
            return self._p2p_problem(p, ctx) or ctx.error(
                CollectiveTimeoutError, f"timed out waiting for rank {dst} ({p.where()}) to take the "
                "message over tcp", missing=[dst], peer=dst, host=p.host)
        self.pump.link.send_frame(dst, frame, ctx.deadline, lambda: self._p2p_problem(p, ctx) is not None,
                                  stopped, lambda e: peer_lost(ctx, p, e, "point-to-point"))

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        if src is None:
            src = self._wait_any_source(ctx)
        elif not self._rx_locks[src].acquire(timeout=max(ctx.deadline - time.monotonic(), 0.0)):
            raise ctx.error(CollectiveTimeoutError, f"timed out waiting for another receive from rank {src}")
        link = self.pump.link
        try:
            p = self.peers[src]
            data = mv(buf)
            idx = self._p2p_rx[src]
            w = Want(src, header(P2P, tag, len(data), 0, idx & 0xFFFFFFFF, len(data)), data, None)
            link.want_p2p(w)
            with link.cv:
                while not w.finished:
                    problem = self._p2p_problem(p, ctx)
                    remaining = ctx.deadline - time.monotonic()
                    if problem is None and remaining <= 0:
                        problem = ctx.error(CollectiveTimeoutError, f"timed out waiting for rank {src} "
                                            f"({p.where()}) to send its message over tcp", missing=[src],
                                            peer=src, host=p.host)
                    if problem is not None:
                        link.withdraw(w)
                        raise problem
                    link.cv.wait(min(remaining, 0.05))
            if not w.ok:
                _m, _kind, gtag, gbytes, _n, _idx, _nb = parse_header(w.header or bytes(HEADER.size))
                with link.cv:
                    link.desync.add(src)
                raise ctx.error(CollectiveMismatchError,
                                f"rank {src} sent a message of {gbytes} bytes with tag {gtag}, but rank "
                                f"{self.rank} expected {len(data)} bytes with tag {tag}", peer=src)
            w.settle()
            self._p2p_rx[src] = idx + 1
            return src
        finally:
            self._rx_locks[src].release()

    def _p2p_problem(self, p: Peer, ctx: OpContext) -> DistBackendError | None:
        """Why a point-to-point operation with ``p`` cannot go on (None: it can)."""
        if self._closed:
            return ctx.error(GroupAbortedError, "the group was destroyed on this rank while this "
                             f"{ctx.op} waited")
        if self.pump.aborted is not None:
            return ctx.error(GroupAbortedError, f"the group was aborted on this rank: {self.pump.aborted}")
        reason = self.pump.link.aborted_by.get(p.rank)
        if reason is not None:
            return ctx.error(GroupAbortedError, f"the group was aborted by rank {p.rank} ({p.where()}): {reason}",
                             aborted_by=p.rank, peer=p.rank)
        if p.rank in self.pump.link.desync:
            return ctx.error(CollectiveMismatchError, f"the stream from rank {p.rank} ({p.where()}) is out "
                             "of step after an earlier error", peer=p.rank)
        if p.gone is not None:
            return peer_lost(ctx, p, None, "point-to-point")
        return None

    def any_source_wanted(self, delta: int) -> None:
        """A receive from any rank that also watches another transport starts (+1) or stops (-1):
        meanwhile messages are read as they come, for :meth:`pending_source`."""
        with self.pump.link.cv:
            self.pump.link.any_waiting(delta)

    def pending_source(self) -> int | None:
        """The lowest rank whose next message has arrived (or is arriving); no waiting."""
        with self.pump.link.cv:
            return self.pump.link.take_any()

    def check_any_source(self, ctx: OpContext) -> None:
        """Raise if a receive from any rank cannot succeed: this side destroyed or aborted, a peer
        aborted the group, or no peer is left that could send."""
        live = []
        for p in self.peers.values():
            problem = self._p2p_problem(p, ctx)
            if problem is not None and (isinstance(problem, GroupAbortedError) or p.rank in self.pump.link.aborted_by):
                raise problem
            if problem is None:
                live.append(p.rank)
        if not live:
            raise ctx.error(DistBackendError, f"no rank is left to send a message: every peer of rank "
                            f"{self.rank} has left, died or is out of step", missing=sorted(self.peers))

    def _wait_any_source(self, ctx: OpContext) -> int:
        """The lowest rank with a message waiting; returns with that rank's receive lock held."""
        link = self.pump.link
        with link.cv:
            link.any_waiting(+1)
            try:
                while True:
                    self.check_any_source(ctx)
                    r = link.take_any()
                    if r is not None and self._rx_locks[r].acquire(blocking=False):
                        return r
                    remaining = ctx.deadline - time.monotonic()
                    if remaining <= 0:
                        raise ctx.error(CollectiveTimeoutError, f"timed out waiting for a message from any of "
                                        f"ranks {sorted(self.peers)}", missing=sorted(self.peers))
                    link.cv.wait(min(remaining, 0.05))
            finally:
                link.any_waiting(-1)

    # -- lifecycle ---------------------------------------------------------------------------
    def wait_stats(self) -> tuple[float, dict[int, float]]:
        return self.pump.wait_s, dict(self.pump.late_s)

    def abort(self, reason: str) -> None:
        """Fail every pending and later call here at once, and tell the peers (ABORT frames)."""
        with self.pump.lock:
            if self.pump.aborted is not None:
                return
            self.pump.aborted = reason
            try:
                os.write(self._wake_w, b"!")
            except OSError:
                pass
            if not self.pump.active:
                self._send_aborts()
        with self.pump.link.cv:
            self.pump.link.cv.notify_all()       # point-to-point waiters look at the flag

    def _send_aborts(self) -> None:
        """Best effort, never blocking: an ABORT frame where the stream is in step, else a shutdown."""
        if self._aborts_sent:
            return
        self._aborts_sent = True
        reason = (self.pump.aborted or "aborted").encode("utf-8", "replace")[:MAX_REASON]
        frame = header(ABORT, 0, 0, 0, 0, len(reason)) + reason
        for r, p in self.peers.items():
            lock = self.pump.link.tx[r]
            held = lock.acquire(timeout=0.2)    # a point-to-point frame in flight stops within 50 ms
            try:
                if not held or p.tx_broken or p.sock.send(frame) != len(frame):
                    p.tx_broken = True
                    p.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                if held:
                    lock.release()

    def close(self) -> None:
        """Say BYE to every peer (so a waiting peer reports 'left the group'), close; never blocks."""
        if self._closed:
            return
        self._closed = True
        with self.pump.link.cv:
            self.pump.link.cv.notify_all()     # a receive still waiting sees the group is gone
        self.pump.link.close()
        bye = header(BYE, 0, 0, 0, 0, 0)
        for r, p in self.peers.items():
            lock = self.pump.link.tx[r]
            if lock.acquire(timeout=0.1):
                try:
                    if not p.tx_broken and self.pump.aborted is None:
                        p.sock.send(bye)
                except OSError:
                    pass
                finally:
                    lock.release()
            p.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

