"""The ``tcp`` transport object: its parts side by side, each behind its own interface.

- the connections, made once by ``mesh.build_mesh`` (listen, publish, connect, handshake:
  [Note: tcp handshake]) and then used through :class:`~.inbox.Inbox` (the receiving side and its
  reader thread: [Note: tcp routing]) and :class:`~.outbox.Outbox` (send locks, ABORT and BYE);
- :class:`~.pump.Pump`: one collective's frames, non-blocking, bounded by its deadline;
- :class:`~.algos.Algorithms`: which algorithm each collective runs (families ``ring`` and
  ``direct``; [Note: tcp reduction order]), over the whole group or a subset;
- :class:`~.p2p.Messages`: point-to-point messages on the same connections.

This object wires them together and holds the policy: a collective that fails aborts the
transport at once (the peers hear it now, not after this rank's report), ``abort`` and ``close``
tell the peers (ABORT and BYE frames) so that they fail at once instead of at their deadline.

Example (what ``init_process_group(backend="tcp")`` does for each group)::

    transport = TcpTransport.create(group_store, rank, world_size, timeout=300.0,
                                    group="default_pg")
    transport.all_reduce(t, RedOpType.SUM, None, ctx)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch

from ringlet import _env
from ringlet.errors import DistBackendError
from ringlet.transport.base import OpContext, Ranks, ReduceArg, Transport
from ringlet.transport.reduce import reduction
from ringlet.transport.tcp.algos import Algorithms
from ringlet.transport.tcp.inbox import Inbox
from ringlet.transport.tcp.mesh import Peer, build_mesh
from ringlet.transport.tcp.outbox import Outbox
from ringlet.transport.tcp.p2p import Messages
from ringlet.transport.tcp.pump import Pump
from ringlet.transport.tcp.wire import interface_address, route_source

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
    subsets = True

    def __init__(self, rank: int, world_size: int, peers: dict[int, Peer], host: str,
                 host_keys: list[str] | None = None, group: str = "") -> None:
        self.rank = rank
        self.world_size = world_size
        self.peers = peers
        self.host = host
        self.inbox = Inbox(rank, peers, f"ringlet-tcp-rx {group} r{rank}")
        self.outbox = Outbox(peers, self.inbox.nudge)
        self.pump = Pump(rank, peers, self.inbox, self.outbox, _env.tcp_chunk_bytes(),
                         _env.tcp_overlap())
        self.algos = Algorithms(self.pump, rank, world_size, host_keys)
        self.messages = Messages(rank, peers, self.inbox, self.outbox)

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

    def _n(self, ranks: Ranks) -> int:
        return self.world_size if ranks is None else len(ranks)

    def all_reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        red = reduction(op, factor, buf.dtype, self._n(ranks))
        self._call(self.algos.all_reduce, buf.view(-1), red, ctx, ranks)

    def reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, root: int,
               ctx: OpContext, ranks: Ranks = None) -> None:
        red = reduction(op, factor, buf.dtype, self._n(ranks))
        self._call(self.algos.reduce, buf.view(-1), red, root, ctx, ranks)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReduceArg,
                       factor: float | None, ctx: OpContext, ranks: Ranks = None) -> None:
        red = reduction(op, factor, out.dtype, self._n(ranks))
        self._call(self.algos.reduce_scatter, inp.view(-1), out.view(-1), red, ctx, ranks)

    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext, ranks: Ranks = None) -> None:
        self._call(self.algos.broadcast, buf.view(-1), root, ctx, ranks)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        self._call(self.algos.all_gather, inp.view(-1), out.view(-1), ctx, ranks)

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: Ranks = None) -> None:
        fo = out.view(-1) if out is not None else None
        self._call(self.algos.gather, inp.view(-1), fo, root, ctx, ranks)

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: Ranks = None) -> None:
        fi = inp.view(-1) if inp is not None else None
        self._call(self.algos.scatter, fi, out.view(-1), root, ctx, ranks)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext, ranks: Ranks = None) -> None:
        self._call(self.algos.all_to_all, inp.view(-1), list(in_splits), out.view(-1),
                   list(out_splits), ctx, ranks)

    def barrier(self, ctx: OpContext, ranks: Ranks = None) -> None:
        self._call(self.algos.barrier, ctx, ranks)

    # -- point to point ----------------------------------------------------------------------
    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        self.messages.send(buf, dst, tag, ctx)

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        return self.messages.recv(buf, src, tag, ctx)

    def watch_any_source(self, delta: int) -> None:
        self.messages.watch(delta)

    def pending_source(self) -> int | None:
        return self.messages.pending_source()

    def check_any_source(self, ctx: OpContext) -> None:
        self.messages.check_any_source(ctx)

    # -- lifecycle ---------------------------------------------------------------------------
    def wait_stats(self) -> tuple[float, dict[int, float]]:
        return self.pump.wait_total(), dict(self.pump.late_s)

    def abort(self, reason: str) -> None:
        """Fail every pending and later call here at once, and tell the peers (ABORT frames)."""
        if self.outbox.abort(reason):
            self.inbox.wake_all()        # a running collective and point-to-point waiters look

    def close(self) -> None:
        """Say BYE to every peer (a waiting peer reports 'left the group'), close; never blocks."""
        if self.outbox.closed:
            return
        self.outbox.closed = True
        self.inbox.close()               # wakes a receive still waiting: the group is gone
        self.outbox.close()
