"""The TCPStore server: one daemon thread running a ``selectors`` loop over
non-blocking sockets in the master process.

Op semantics live in ``_table.KeyTable`` (pure); this module only moves bytes,
enforces the handshake deadline, connection cap and frame caps, and parks
``get``/``wait`` requests until a write completes them (no polling). Any fault on one
connection closes that connection only; the loop itself never dies on client input.
Wire format and handshake: [Note: store protocol] in ``_protocol``.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import hmac
import logging
import os
import selectors
import socket
import threading
import time
import weakref
from collections import deque
from typing import Any

from ringlet.errors import DistNetworkError
from ringlet.store import _protocol as P
from ringlet.store import _table as T
from ringlet.store._secret import create_secret, remove_secret

log = logging.getLogger("ringlet.store")

_SERVER_JOIN_S = 2.0  # close(): bound on joining the server thread
_RECV_BYTES = 1 << 18


class _Conn:
    """Server side of one client connection."""

    def __init__(self, sock: socket.socket, nonce: bytes, deadline: float) -> None:
        self.sock = sock
        self.nonce = nonce
        self.deadline = deadline  # handshake deadline (monotonic)
        self.hello = bytearray()
        self.reader: P.FrameReader | None = None  # set once authenticated
        self.out: deque[memoryview] = deque()
        self.parked: T.Parked | None = None
        self.closed = False
        self.close_after_flush = False


class StoreServer:
    """The store server loop (runs in a daemon thread of the master process)."""

    def __init__(self, listener: socket.socket, token: bytes, host: str,
                 secret_id: str = "") -> None:
        bound_ip, self.port = listener.getsockname()[:2]
        # Where the master's own client connects: the bound address, loopback for "any".
        self.connect_host: str = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bound_ip, bound_ip)
        self.where = f"{host}:{self.port}"
        self.refs = 1  # TCPStore instances using this server (multi_tenant shares it)
        self.shared_key: tuple[str, int] | None = None
        self._listener = listener
        self.token = token  # the run token, or the host secret of ``secret_id``
        self.secret_id = secret_id  # [Note: host secret] in _secret; "" for a run token
        self._accept_paused_until = 0.0  # EMFILE back-off: the listener is out of the selector
        self._accept_backoff = 0.0
        self._handshake_s = P.HANDSHAKE_TIMEOUT_S  # read now, so tests can shorten it
        self._told_torch = False  # a torch client was reported (once per server)
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._table = T.KeyTable()
        self._conns: set[_Conn] = set()
        self._unauthed: deque[_Conn] = deque()  # in accept order = deadline order
        self._stopping = False
        self._pid = os.getpid()
        self.joined = 0
        self.claimed_ranks: list[int] = []
        self.join_cond = threading.Condition()
        listener.setblocking(False)
        self._wake_r.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ, "accept")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(
            target=self._run, name=f"ringlet-store-server {self.where}", daemon=True
        )
        self._thread.start()
        _LIVE_SERVERS.add(self)

    def stop(self) -> None:
        """Stop the loop, close every connection and the listening socket (bounded)."""
        if os.getpid() != self._pid:
            return  # a forked copy: the server belongs to the parent
        self._stopping = True
        if self.secret_id:
            remove_secret(self.secret_id)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if threading.current_thread() is not self._thread:
            self._thread.join(_SERVER_JOIN_S)
            if self._thread.is_alive():
                log.warning("store server %s did not stop within %ss", self.where, _SERVER_JOIN_S)

    def wait_joined(self, n: int, deadline: float) -> bool:
        with self.join_cond:
            while self.joined < n:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.join_cond.wait(remaining)
            return True

    # -- the loop ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, _ in self._sel.select(self._next_timeout()):
                    self._dispatch(key)
                self._expire_handshakes()
                self._resume_accepting()
        except Exception:  # a bug here must not spam every rank; log once and shut down
            log.exception("store server %s failed; shutting down", self.where)
        finally:
            for conn in list(self._conns):
                self._drop(conn)
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()
            self._sel.close()

    def _next_timeout(self) -> float | None:
        wakes = [c.deadline for c in self._unauthed if not c.closed][:1]
        if self._accept_paused_until:
            wakes.append(self._accept_paused_until)
        if not wakes:
            return None
        return max(0.0, min(wakes) - time.monotonic())

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        while self._unauthed and (
            self._unauthed[0].reader is not None
            or self._unauthed[0].closed
            or self._unauthed[0].deadline <= now
        ):
            conn = self._unauthed.popleft()
            if conn.reader is None and not conn.closed:
                log.debug("store %s: dropped a connection idle in its handshake", self.where)
                self._drop(conn)

    def _dispatch(self, key: selectors.SelectorKey) -> None:
        if key.data == "accept":
            self._accept()
        elif key.data == "wake":
            try:
                self._wake_r.recv(64)
            except OSError:
                pass
        else:
            conn: _Conn = key.data
            if conn.closed:
                return
            try:
                if conn.out:
                    self._flush(conn)
                else:
                    self._on_readable(conn)
            except (OSError, P.ProtocolError) as e:
                log.debug("store %s: closing a connection: %s", self.where, e)
                self._drop(conn)
            except Exception:  # a bug must cost one connection, never the server
                log.exception("store %s: internal error; closing that connection", self.where)
                self._drop(conn)

    def _accept(self) -> None:
        for _ in range(64):  # bounded batch; the selector reports the rest
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                # EMFILE/ENFILE/ENOBUFS: the pending connection stays queued, so the listener stays
                # readable and select() would return at once forever.  Stop watching it for a while
                # (doubling, up to 1 s) and keep serving the clients already connected.
                self._pause_accepting(e)
                return
            self._accept_backoff = 0.0
            if len(self._conns) >= P.MAX_CONNECTIONS:
                sock.close()
                continue
            self._admit(sock)

    def _admit(self, sock: socket.socket) -> None:
        pending = [c for c in self._unauthed if c.reader is None and not c.closed]
        if len(pending) >= P.MAX_PENDING:   # the oldest unauthenticated one makes room
            self._drop(pending[0])
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(sock, os.urandom(32), time.monotonic() + self._handshake_s)
        self._conns.add(conn)
        self._unauthed.append(conn)
        self._sel.register(sock, selectors.EVENT_READ, conn)
        flags = P.SERVER_NEEDS_TOKEN | (P.SERVER_HOST_SECRET if self.secret_id else 0)
        sid = self.secret_id.encode("ascii")
        self._send(conn, P.SERVER_HELLO.pack(P.MAGIC, P.VERSION, flags, conn.nonce, sid))

    def _pause_accepting(self, err: OSError) -> None:
        self._accept_backoff = min(max(self._accept_backoff * 2, 0.01), 1.0)
        self._accept_paused_until = time.monotonic() + self._accept_backoff
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._listener)
        log.warning("store %s: accept failed (%s); not accepting for %.2f s", self.where, err,
                    self._accept_backoff)

    def _resume_accepting(self) -> None:
        if self._accept_paused_until and time.monotonic() >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, "accept")

    def _on_readable(self, conn: _Conn) -> None:
        if conn.reader is None:  # handshake: read no more than the fixed-size hello
            data = conn.sock.recv(P.CLIENT_HELLO.size - len(conn.hello))
            if not data:
                raise P.ProtocolError("closed during the handshake")
            conn.hello += data
            if conn.hello[:len(P.TORCH_HELLO)] == P.TORCH_HELLO:
                self._torch_client(conn)
            if len(conn.hello) == P.CLIENT_HELLO.size:
                self._authenticate(conn)
            return
        data = conn.sock.recv(_RECV_BYTES)
        if not data:
            raise P.ProtocolError("closed by the client")
        for payload in conn.reader.feed(data):
            self._on_request(conn, payload)

    def _torch_client(self, conn: _Conn) -> None:
        """A torch.distributed TCPStore client: say once what went wrong, then drop it."""
        if not self._told_torch:
            self._told_torch = True
            log.warning(
                "ringlet store %s: a torch.distributed client connected (torch's TCPStore "
                "protocol; this store is ringlet's): a program written for torch.distributed was "
                "started by ringlet-run, or given a ringlet store's address. Launch it with "
                "`ringlet-run --torch-backend`, or with torchrun, or port it to "
                "ringlet.distributed (docs/migration.md)", self.where)
        raise P.ProtocolError("a torch.distributed TCPStore client")

    def _authenticate(self, conn: _Conn) -> None:
        magic, version, flags, mac, rank = P.CLIENT_HELLO.unpack(conn.hello)
        if magic != P.MAGIC:
            raise P.ProtocolError("bad magic in the client hello")
        status = P.HS_OK
        if version != P.VERSION:
            status = P.HS_BAD_VERSION
        elif not (
            flags & P.CLIENT_HAS_MAC
            and hmac.compare_digest(mac, P.token_mac(self.token, conn.nonce))
        ):
            status = P.HS_BAD_TOKEN
        if status != P.HS_OK:
            log.debug("store %s: refused a client (handshake status %d)", self.where, status)
            conn.close_after_flush = True
            self._send(conn, bytes([status]))
            return
        conn.reader = P.FrameReader()
        self._send(conn, bytes([P.HS_OK]))
        if flags & P.CLIENT_JOINS:
            with self.join_cond:
                self.joined += 1
                if rank >= 0:
                    self.claimed_ranks.append(rank)
                self.join_cond.notify_all()

    def _on_request(self, conn: _Conn, payload: bytes) -> None:
        op, args = P.decode_payload(payload)
        if op == P.Op.CANCEL:
            if conn.parked is not None:
                self._table.cancel(conn.parked)
                conn.parked = None
            self._send(conn, P.encode_frame(P.Status.CANCELED, []))
            return
        if conn.parked is not None:
            raise P.ProtocolError("request sent while another one is parked")
        result = self._table.handle(conn, op, args)
        if isinstance(result, T.Parked):
            conn.parked = result
        else:
            self._send(conn, P.encode_frame(result[0], result[1]))
        for owner, (status, values) in self._table.pop_ready():
            if isinstance(owner, _Conn) and not owner.closed:
                owner.parked = None
                self._send(owner, P.encode_frame(status, values))

    # -- output ------------------------------------------------------------------
    def _send(self, conn: _Conn, data: bytes) -> None:
        conn.out.append(memoryview(data))
        try:
            self._flush(conn)
        except OSError as e:
            log.debug("store %s: send failed: %s", self.where, e)
            self._drop(conn)

    def _flush(self, conn: _Conn) -> None:
        # Back-pressure: while a reply is queued we stop reading that client's requests.
        while conn.out:
            try:
                n = conn.sock.send(conn.out[0])
            except (BlockingIOError, InterruptedError):
                self._sel.modify(conn.sock, selectors.EVENT_WRITE, conn)
                return
            conn.out[0] = conn.out[0][n:]
            if not len(conn.out[0]):
                conn.out.popleft()
        if conn.close_after_flush:
            self._drop(conn)
        elif not conn.closed:
            self._sel.modify(conn.sock, selectors.EVENT_READ, conn)

    def _drop(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.parked is not None:
            self._table.cancel(conn.parked)
            conn.parked = None
        self._conns.discard(conn)
        try:
            self._sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()


_LIVE_SERVERS: weakref.WeakSet[StoreServer] = weakref.WeakSet()
_SHARED: dict[tuple[str, int], StoreServer] = {}  # multi_tenant servers by (host, port)
_SHARED_LOCK = threading.Lock()


def acquire_server(
    host: str, port: int, token: bytes | None, listen_fd: int | None, shared: bool
) -> StoreServer:
    """Start a server, or with ``shared`` reuse this process's server on (host, port).

    Every call must be paired with ``release_server``; the last release stops it.
    """
    with _SHARED_LOCK:
        server = _SHARED.get((host, port)) if shared and port != 0 else None
        if server is not None:
            server.refs += 1
            return server
        listener = (listener_from_fd(listen_fd) if listen_fd is not None
                    else bind_listener(host, port))
        secret_id = ""
        if token is None:   # [Note: host secret]: same-user processes of this host can still join
            try:
                secret_id, token = create_secret()
            except BaseException:
                listener.close()
                raise
        server = StoreServer(listener, token, host, secret_id)
        if shared:
            server.shared_key = (host, server.port)
            _SHARED[server.shared_key] = server
        return server


def release_server(server: StoreServer) -> None:
    with _SHARED_LOCK:
        server.refs -= 1
        if server.refs > 0:
            return
        if server.shared_key is not None:
            _SHARED.pop(server.shared_key, None)
    server.stop()


@atexit.register
def _stop_live_servers() -> None:
    for server in list(_LIVE_SERVERS):
        server.stop()


def bind_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket on exactly ``host`` (``""``/``"0.0.0.0"`` mean every interface).

    Raises:
        DistNetworkError: the address cannot be resolved or bound; names host, port and
            the errno (e.g. ``EADDRINUSE``).
    """
    addr: tuple[Any, ...]
    try:
        if host in ("", "0.0.0.0"):
            family, addr = socket.AF_INET, ("0.0.0.0", port)
        else:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            infos.sort(key=lambda info: info[0] != socket.AF_INET)  # prefer IPv4
            family, addr = infos[0][0], infos[0][4]
    except socket.gaierror as e:
        raise DistNetworkError(
            f"TCPStore server cannot resolve host {host!r} (port {port}): {e}", host=host, port=port
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        sock.close()
        name = errno.errorcode.get(e.errno or 0, str(e.errno))
        hint = ""
        if e.errno == errno.EADDRINUSE and P.under_torchrun():
            hint = "; " + P.TORCH_MIXUP.format(where=f"{host}:{port}")
        raise DistNetworkError(
            f"TCPStore server could not bind {host}:{port}: {name} ({e.strerror}){hint}",
            host=host, port=port, errno=name,
        ) from None
    return sock


def listener_from_fd(fd: int) -> socket.socket:
    """A listening socket on a duplicate of ``fd`` (the caller keeps its own)."""
    sock = socket.socket(fileno=os.dup(fd))
    sock.listen(2048)
    return sock

