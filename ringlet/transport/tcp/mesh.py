"""The ``tcp`` transport's connection mesh: listen, publish, connect, authenticate.

Every rank listens on port 0 of its address, publishes ``host:port`` (and pid,
hostname) under ``tcp/addr/<rank>`` in the group's store, then connects to every
lower rank and accepts every higher one: one connection per pair of ranks, which
carries collectives and point-to-point messages alike ([Note: tcp routing] in
``inbox``).  See [Note: tcp handshake] in ``wire``.  The
listener is closed as soon as the mesh is complete: nothing stays open to
strangers.  The order (connect down, then accept up) cannot deadlock: rank 0
accepts at once, and every rank's connects only need lower ranks, which accept
as soon as their own connects are done.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import secrets
import selectors
import socket
import time
from datetime import timedelta
from typing import Any

from ringlet.errors import DistNetworkError, DistStoreError
from ringlet.store._protocol import ConnectionLost
from ringlet.store.tcp import effective_token
from ringlet.transport.tcp.wire import (
    CONNECT_HELLO,
    HS_OK,
    accept_hello,
    connect_handshake,
    judge_connect_hello,
    refusal,
)

__all__ = ["Peer", "build_mesh"]

log = logging.getLogger("ringlet")

# an accepted connection must finish its handshake within this (anti-slowloris)
HANDSHAKE_S = 5.0
MAX_PENDING = 64      # connections in their handshake at once; a new one drops the oldest
# A send buffer that holds a whole pipelining chunk or more lets a rank hand its next chunks to the
# kernel while its peer is busy reducing, instead of waiting for autotuning to grow from 16 KiB
# (measured on loopback here: 1 MiB all_reduce 1.1 ms with it, 2.2-3.0 ms without, noisy box).
# The kernel caps it at net.core.wmem_max; receive buffers stay autotuned (up to tcp_rmem's max).
SNDBUF = 4 << 20
CHANNELS = (0,)       # the handshake names a channel; one connection per pair uses channel 0


@dataclasses.dataclass(eq=False)
class Peer:
    """One remote rank of the group and its connection."""

    rank: int                       # group rank
    host: str                       # the address it published (and connects from)
    port: int
    pid: int
    hostname: str
    sock: socket.socket             # collectives and point-to-point messages
    tx_broken: bool = False         # a frame was cut mid-way: the stream is out of step
    gone: str | None = None         # "bye" (left the group), "eof" (closed), "reset ..." once seen

    def __post_init__(self) -> None:
        self.fd = self.sock.fileno()

    def where(self) -> str:
        return f"pid {self.pid} at {self.host}:{self.port} on host {self.hostname}"

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _bind_listener(host: str, group: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(1024)   # a burst of strangers must not fill the backlog before we accept
    except OSError as e:
        sock.close()
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        raise DistNetworkError(f"group {group}: tcp transport cannot listen on "
                               f"{host}: {name} ({e.strerror}); set RINGLET_IFNAME to "
                               "the interface the hosts share", host=host) from None
    return sock


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) < SNDBUF:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
    sock.setblocking(False)


def build_mesh(store: Any, rank: int, world_size: int, timeout: float, group: str, host: str,
               token: bytes | None) -> dict[int, Peer]:
    """Connect this rank to every other rank of the group (see the module docstring).

    Raises:
        DistNetworkError: a peer cannot be reached, refused us, or never connected;
            names the rank and its address.
        DistStoreError: a rank never published its address within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    # no run token: the store's host secret keys the handshake (docs/security.md)
    if token is None:
        token = effective_token(store)
    listener = _bind_listener(host, group)
    socks: dict[tuple[int, int], socket.socket] = {}
    try:
        port = listener.getsockname()[1]
        if rank == 0:
            store.set("tcp/gid", secrets.token_hex(16))
        me = {"host": host, "port": port, "pid": os.getpid(), "hostname": socket.gethostname()}
        store.set(f"tcp/addr/{rank}", json.dumps(me))
        keys = [f"tcp/addr/{r}" for r in range(world_size)] + ["tcp/gid"]
        try:
            store.wait(keys, timedelta(seconds=max(deadline - time.monotonic(), 0.01)))
        except DistStoreError:
            missing = [r for r in range(world_size) if not store.check([f"tcp/addr/{r}"])]
            raise DistStoreError(f"group {group}: ranks {missing} never published a tcp "
                                 f"address within {timeout:.1f} s",
                                 group=group, missing=missing) from None
        infos = [json.loads(store.get(f"tcp/addr/{r}")) for r in range(world_size)]
        gid = store.get("tcp/gid")
        for r in range(rank):
            for ch in CHANNELS:
                socks[(r, ch)] = _connect(infos[r], host, rank, r, ch, token, gid, deadline, group)
        expected = {(r, ch): infos[r]["host"] for r in range(rank + 1, world_size)
                    for ch in CHANNELS}
        socks.update(_accept_all(listener, rank, token, gid, expected, deadline, group))
    except BaseException:
        for s in socks.values():
            s.close()
        raise
    finally:
        listener.close()
    peers = {}
    for r in range(world_size):
        if r != rank:
            info = infos[r]
            for ch in CHANNELS:
                _tune(socks[(r, ch)])
            peers[r] = Peer(r, info["host"], info["port"], info["pid"], info["hostname"],
                            socks[(r, 0)])
    return peers


def _connect(info: dict[str, Any], my_host: str, me: int, target: int, channel: int,
             token: bytes | None, gid: bytes, deadline: float, group: str) -> socket.socket:
    """Connect to ``target`` from our own address (so that its source check holds), with retries."""
    where = f"{info['host']}:{info['port']}"
    delay, last = 0.01, None
    while True:
        family = socket.AF_INET6 if ":" in info["host"] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((my_host, 0))
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            sock.connect((info["host"], info["port"]))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connect_handshake(sock, me, target, channel, token, gid, deadline, where)
            return sock
        except DistNetworkError:
            sock.close()
            raise
        except (OSError, ConnectionLost) as e:
            sock.close()
            last = e
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise DistNetworkError(f"group {group}: rank {me} could not connect to rank "
                                   f"{target} at {where} (pid {info['pid']} on host "
                                   f"{info['hostname']}): {last!r}",
                                   peer=target, address=where)
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, 0.5)


@dataclasses.dataclass(eq=False)
class _Pending:
    """An accepted connection that has not finished its handshake."""

    sock: socket.socket
    ip: str
    nonce: bytes
    deadline: float
    got: bytearray = dataclasses.field(default_factory=bytearray)


class _Acceptor:
    """Accepts and handshakes many connections at once on non-blocking sockets.

    Each connection has its own deadline (``HANDSHAKE_S``), so an idle or slow one never delays
    another; at most ``MAX_PENDING`` wait in their handshake (a new arrival drops the oldest, whose
    connector -- if it was a real rank -- retries); garbage is dropped as soon as its fixed-size
    hello is complete.  Only (rank, channel) pairs of the rendezvous table still awaited, from the
    address that rank published, with the right MAC, are admitted.
    """

    def __init__(self, listener: socket.socket, me: int, token: bytes | None, gid: bytes,
                 expected: dict[tuple[int, int], str], group: str) -> None:
        self.listener, self.me, self.token, self.gid = listener, me, token, gid
        self.expected, self.group = expected, group
        self.got: dict[tuple[int, int], socket.socket] = {}
        self.refused: list[str] = []
        self.pending: dict[socket.socket, _Pending] = {}   # in accept order
        self.sel = selectors.DefaultSelector()
        listener.setblocking(False)
        self.sel.register(listener, selectors.EVENT_READ, None)

    def run(self, deadline: float) -> dict[tuple[int, int], socket.socket]:
        try:
            while self.expected:
                now = time.monotonic()
                if now >= deadline:
                    raise self._missing_error()
                wake = min([deadline] + [p.deadline for p in self.pending.values()])
                for key, _ in self.sel.select(max(wake - now, 0.0)):
                    if key.data is None:
                        self._accept_batch()
                    else:
                        self._advance(key.data)
                self._expire(time.monotonic())
            return self.got
        except BaseException:
            for s in self.got.values():
                s.close()
            raise
        finally:
            for p in list(self.pending.values()):
                self._drop(p, None)
            self.sel.close()

    def _missing_error(self) -> DistNetworkError:
        missing = sorted({r for r, _ in self.expected})
        why = f"; refused: {'; '.join(self.refused[-3:])}" if self.refused else ""
        host, port = self.listener.getsockname()[:2]
        return DistNetworkError(f"group {self.group}: ranks {missing} never connected to rank "
                                f"{self.me} at {host}:{port} within the timeout{why}",
                                missing=missing)

    def _accept_batch(self) -> None:
        for _ in range(64):          # bounded; the selector reports the rest
            try:
                sock, addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:     # EMFILE and friends: the connectors retry
                log.warning("group %s: rank %d could not accept: %s", self.group, self.me, e)
                return
            if len(self.pending) >= MAX_PENDING:
                self._drop(next(iter(self.pending.values())), "too many "
                           "connections in their handshake")
            hello, nonce = accept_hello(self.me)
            sock.setblocking(False)
            p = _Pending(sock, addr[0], nonce, time.monotonic() + HANDSHAKE_S)
            try:
                sock.send(hello)     # a few dozen bytes into an empty socket buffer
            except OSError:
                sock.close()
                continue
            self.pending[sock] = p
            self.sel.register(sock, selectors.EVENT_READ, p)

    def _advance(self, p: _Pending) -> None:
        try:
            data = p.sock.recv(CONNECT_HELLO.size - len(p.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self._drop(p, str(e))
            return
        if not data:
            self._drop(p, "closed during the handshake")
            return
        p.got += data
        if len(p.got) < CONNECT_HELLO.size:
            return
        try:
            status, claimed, channel, reply = judge_connect_hello(
                bytes(p.got), self.me, p.nonce, self.token, self.gid, self.expected, p.ip)
            p.sock.send(reply)
        except (DistNetworkError, OSError) as e:
            self._drop(p, str(e))
            return
        if status != HS_OK:
            self._drop(p, str(refusal(status, claimed, channel, p.ip)))
            return
        self.sel.unregister(p.sock)
        del self.pending[p.sock]
        self.got[(claimed, channel)] = p.sock
        del self.expected[(claimed, channel)]

    def _expire(self, now: float) -> None:
        for p in [p for p in self.pending.values() if p.deadline <= now]:
            self._drop(p, "did not finish its handshake in time")

    def _drop(self, p: _Pending, why: str | None) -> None:
        self.pending.pop(p.sock, None)
        try:
            self.sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass
        p.sock.close()
        if why is not None:
            log.debug("group %s: rank %d dropped a connection from %s: %s",
                      self.group, self.me, p.ip, why)
            self.refused.append(f"{p.ip}: {why}")
            del self.refused[:-8]


def _accept_all(listener: socket.socket, me: int, token: bytes | None, gid: bytes,
                expected: dict[tuple[int, int], str], deadline: float,
                group: str) -> dict[tuple[int, int], socket.socket]:
    """Accept until every expected (rank, channel) connected; strangers are
    dropped (``_Acceptor``)."""
    return _Acceptor(listener, me, token, gid, expected, group).run(deadline)
