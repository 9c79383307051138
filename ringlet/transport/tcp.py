"""The ``tcp`` transport: ranks anywhere, one authenticated connection per peer pair and purpose.

How it fits together:

- ``_tcp_wire``: frame headers and the token handshake ([Note: tcp frames],
  [Note: tcp handshake]); which address to listen on.
- ``_tcp_mesh``: listen on port 0, publish ``host:port`` in the group's store, connect.
- ``_tcp_pump``: non-blocking, deadline-bounded movement of frames for one operation.
- ``_tcp_algos``: the reducing collectives ([Note: tcp reduction order]); ``_tcp_moves``: the
  data-movement ones.

This module holds the transport object: collectives delegate to the algorithms,
point-to-point messages use the second connection of each pair (one frame per
message, ordered, checked against the receiver's tag and size before the payload
is read), and ``abort``/``close`` tell the peers (ABORT and BYE frames) so that
they fail at once instead of at their deadline.

Example (what ``init_process_group(backend="tcp")`` does for each group)::

    transport = TcpTransport.create(group_store, rank, world_size, timeout=300.0, group="default_pg")
    transport.all_reduce(t, RedOpType.SUM, None, ctx)
"""

from __future__ import annotations

import os
import select
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
from ringlet.transport._tcp_mesh import Peer, build_mesh
from ringlet.transport._tcp_pump import HSIZE, Pump, peer_lost
from ringlet.transport._tcp_wire import (
    ABORT,
    BYE,
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
                 host_keys: list[str] | None = None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.peers = peers
        self.host = host
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.pump = Pump(rank, peers, self._wake_r)
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
        return cls(rank, world_size, peers, host, host_keys)

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
        while frame:
            self._check_aborted(ctx)
            try:
                n = p.psock.sendmsg(frame)
            except BlockingIOError:
                self._wait_io(p, select.POLLOUT, ctx, "to take the message")
                continue
            except OSError as e:
                raise peer_lost(ctx, p, e, "point-to-point") from None
            while frame and n >= len(frame[0]):
                n -= len(frame.pop(0))
            if frame:
                frame[0] = frame[0][n:]

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        if src is None:
            src = self._wait_any_source(ctx)
        else:
            if not self._rx_locks[src].acquire(timeout=max(ctx.deadline - time.monotonic(), 0.0)):
                raise ctx.error(CollectiveTimeoutError, f"timed out waiting for another receive from rank {src}")
        try:
            p = self.peers[src]
            data = mv(buf)
            idx = self._p2p_rx[src]
            want = header(P2P, tag, len(data), 0, idx & 0xFFFFFFFF, len(data))
            got = self._read(p, memoryview(bytearray(HSIZE)), ctx)
            if bytes(got) != want:
                _m, _kind, gtag, gbytes, _n, _idx, _nb = parse_header(bytes(got))
                p.gone = p.gone or "desync"
                raise ctx.error(CollectiveMismatchError,
                                f"rank {src} sent a message of {gbytes} bytes with tag {gtag}, but rank "
                                f"{self.rank} expected {len(data)} bytes with tag {tag}", peer=src)
            self._read(p, data, ctx)
            self._p2p_rx[src] = idx + 1
            return src
        finally:
            self._rx_locks[src].release()

    def _read(self, p: Peer, view: memoryview, ctx: OpContext) -> memoryview:
        got = 0
        while got < len(view):
            self._check_aborted(ctx)
            try:
                n = p.psock.recv_into(view[got:])
            except BlockingIOError:
                self._wait_io(p, select.POLLIN, ctx, "to send its message")
                continue
            except OSError as e:
                raise peer_lost(ctx, p, e, "point-to-point") from None
            if n == 0:
                raise peer_lost(ctx, p, None, "point-to-point")
            got += n
        return view

    def _wait_io(self, p: Peer, events: int, ctx: OpContext, what: str) -> None:
        poller = select.poll()
        poller.register(p.pfd, events)
        poller.register(self._wake_r, select.POLLIN)
        remaining = ctx.deadline - time.monotonic()
        if remaining <= 0 or not poller.poll(remaining * 1000.0):
            raise ctx.error(CollectiveTimeoutError, f"timed out waiting for rank {p.rank} ({p.where()}) "
                            f"{what} over tcp", missing=[p.rank], peer=p.rank, host=p.host)

    def _wait_any_source(self, ctx: OpContext) -> int:
        """The lowest rank with a message waiting; returns with that rank's receive lock held."""
        while True:
            self._check_aborted(ctx)
            poller = select.poll()
            for p in self.peers.values():
                poller.register(p.pfd, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            remaining = ctx.deadline - time.monotonic()
            ready = poller.poll(remaining * 1000.0) if remaining > 0 else []
            if not ready:
                raise ctx.error(CollectiveTimeoutError, f"timed out waiting for a message from any of ranks "
                                f"{sorted(self.peers)}", missing=sorted(self.peers))
            fds = {fd for fd, _ in ready}
            for r, p in sorted(self.peers.items()):
                if p.pfd in fds and self._rx_locks[r].acquire(blocking=False):
                    try:
                        peek = p.psock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                    except BlockingIOError:
                        self._rx_locks[r].release()     # another receive took it first
                        continue
                    except OSError:
                        peek = b""
                    del peek
                    return r
            time.sleep(0.001)    # the readable ones are being read by another receive

    def _check_aborted(self, ctx: OpContext) -> None:
        if self.pump.aborted is not None:
            raise ctx.error(GroupAbortedError, f"the group was aborted on this rank: {self.pump.aborted}")

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

    def _send_aborts(self) -> None:
        """Best effort, never blocking: an ABORT frame where the stream is in step, else a shutdown."""
        if self._aborts_sent:
            return
        self._aborts_sent = True
        reason = (self.pump.aborted or "aborted").encode("utf-8", "replace")[:MAX_REASON]
        frame = header(ABORT, 0, 0, 0, 0, len(reason)) + reason
        for p in self.peers.values():
            try:
                if p.tx_broken or p.sock.send(frame) != len(frame):
                    p.tx_broken = True
                    p.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:
                p.psock.shutdown(socket.SHUT_RDWR)   # peers blocked in a receive from us: EOF now
            except OSError:
                pass

    def close(self) -> None:
        """Say BYE to every peer (so a waiting peer reports 'left the group'), close; never blocks."""
        if self._closed:
            return
        self._closed = True
        bye = header(BYE, 0, 0, 0, 0, 0)
        for p in self.peers.values():
            if not p.tx_broken and self.pump.aborted is None:
                try:
                    p.sock.send(bye)
                except OSError:
                    pass
            p.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

