"""``TCPStore``: the rendezvous store every rank reaches over TCP.

The master instance starts the server (``_server.StoreServer``) in a daemon thread
of its process; every instance, the master's included, is a client with one
connection per thread (``threading.local``), so a ``get`` blocked in one thread never
delays another thread's ``set``. Wire format and handshake: [Note: store protocol]
in ``_protocol``.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import weakref
from datetime import timedelta

from ringlet import _env
from ringlet.errors import DistNetworkError, DistStoreError, QueueEmptyError
from ringlet.store import _protocol as P
from ringlet.store._server import StoreServer, acquire_server, release_server
from ringlet.store.base import (
    Store,
    check_key,
    check_keys,
    check_pairs,
    queue_empty_error,
    timeout_error,
    to_bytes,
)

__all__ = ["TCPStore"]

_CANCEL_GRACE_S = 5.0  # after a timed-out wait: how long the server gets to ack CANCEL
_MAX_BACKOFF_S = 1.0  # connect retries: 10 ms doubling up to this


class _ClientConn:
    """One client connection (owned by one thread of one process)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = os.getpid()  # a forked child must not share its parent's stream

    def close(self) -> None:
        if self.pid == os.getpid():  # after fork, shutdown would cut the parent's stream too
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        self.sock.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class TCPStore(Store):
    """A key-value store served over TCP by the master process (torch's ``TCPStore``).

    Args:
        host_name: the server's address; the master binds exactly this address
            (``""``/``"0.0.0.0"`` only when given explicitly mean every interface).
        port: the server's port; ``0`` on the master picks a free one (see ``.port``).
        world_size: participants (master included) for ``wait_for_workers``.
        is_master: start the server in this process.
        timeout: deadline of connecting, ``get`` and ``wait`` (default ``RINGLET_TIMEOUT``).
        wait_for_workers: on the master, block until ``world_size`` instances joined.
        multi_tenant: several master instances in one process share one server per port.
        master_listen_fd: an already bound listening socket for the server to use.
        use_libuv: accepted for torch compatibility; ignored.
        token: run token for the HMAC handshake (default ``RINGLET_STORE_TOKEN[_FILE]``).  A
            master without one draws a host secret that only processes of its user on its host
            can read, and clients without one prove that secret ([Note: host secret]).
        rank: the rank this instance claims when joining (default ``RANK``), named in
            ``wait_for_workers`` errors.

    Raises:
        DistNetworkError: the server cannot bind (names host, port, errno), or no
            server answered within ``timeout`` (names host:port, attempts, elapsed).
        DistStoreError: the server refused the run token, or workers did not join.

    Example::

        server = TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
        client = TCPStore("127.0.0.1", server.port, world_size=2)
        client.set("k", b"v")
        assert server.get("k") == b"v"
    """

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: int | None = None,
        is_master: bool = False,
        timeout: timedelta | None = None,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: int | None = None,
        use_libuv: bool = True,
        *,
        token: bytes | None = None,
        rank: int | None = None,
    ) -> None:
        super().__init__(timeout)
        self._closed = True  # until fully constructed: __del__ must not act
        _validate(host_name, port, world_size, is_master)
        token = token if token is not None else _env.store_token()
        self._init_client(host_name, port, world_size, token,
                          rank if rank is not None else _env.env_rank())
        self._is_master = is_master
        if is_master:
            self._start_server(multi_tenant, master_listen_fd)
        self._closed = False
        try:
            self._local.conn = self._connect(join=True)
            if is_master and wait_for_workers and world_size is not None and world_size > 0:
                self._wait_for_workers(world_size)
        except BaseException:
            self.close()
            raise

    # -- construction -----------------------------------------------------------
    def _init_client(self, host: str, port: int, world_size: int | None, token: bytes | None,
                     rank: int | None) -> None:
        self._host, self._port, self._world_size = host, port, world_size
        self._is_master = False
        self._token = token
        self._rank = rank
        self._local = threading.local()
        self._conns_lock = threading.Lock()
        # Weak: a dead thread's connection is closed when its threading.local goes away.
        self._conns: weakref.WeakSet[_ClientConn] = weakref.WeakSet()
        self._lost: str | None = None
        self._ever_connected = False
        self._server: StoreServer | None = None
        self._connect_host = host

    def clone(self) -> TCPStore:
        """A new client of the same server (torch's ``clone``): its own connections, so that
        another thread can use it freely; it never owns the server, even when cloned from the
        master, and does not count as a joining worker.

        Example::

            worker_store = store.clone()   # hand to a thread
        """
        other = TCPStore.__new__(TCPStore)
        Store.__init__(other, self.timeout)
        other._closed = True
        other._init_client(self._host, self._port, self._world_size, self._token, self._rank)
        other._connect_host = self._connect_host
        other._closed = False
        other._local.conn = other._connect(join=False)
        return other

    def _start_server(self, multi_tenant: bool, listen_fd: int | None) -> None:
        self._server = acquire_server(self._host, self._port, self._token, listen_fd, multi_tenant)
        self._port, self._connect_host = self._server.port, self._server.connect_host
        self._token = self._server.token   # the run token, or the host secret it drew

    def _wait_for_workers(self, n: int) -> None:
        if self._server is None:
            raise AssertionError("wait_for_workers needs the server of this master")
        started = time.monotonic()
        if self._server.wait_joined(n, started + self._timeout_s):
            return
        with self._server.join_cond:
            joined, claims = self._server.joined, list(self._server.claimed_ranks)
        claimed = sorted(set(claims))
        missing = [r for r in range(n) if r not in claimed]
        detail = f"; missing ranks {missing} (claimed: {claimed})" if claimed else ""
        twice = [r for r in claimed if claims.count(r) > 1]
        detail += f"; ranks claimed more than once: {twice}" if twice else ""
        raise DistStoreError(
            f"TCPStore {self._where}: timed out after {time.monotonic() - started:.1f}s waiting "
            f"for workers: {joined}/{n} joined{detail}",
            store=self._where, joined=joined, world_size=n,
            missing_ranks=missing if claimed else None,
        )

    def _connect(self, join: bool) -> _ClientConn:
        started = time.monotonic()
        deadline, attempts, delay = started + self._timeout_s, 0, 0.01
        last: BaseException | None = None
        while True:
            attempts += 1
            try:
                sock = socket.create_connection(
                    (self._connect_host, self._port), timeout=max(deadline - time.monotonic(), 0.01)
                )
            except ConnectionRefusedError as e:
                if self._ever_connected:  # it was up: refused now means it is gone (S3)
                    raise self._connection_lost(e) from None
                last = e
            except OSError as e:
                last = e
            else:
                try:
                    return self._handshake(sock, join, deadline)
                except (P.ConnectionLost, P.DeadlinePassed, OSError) as e:
                    sock.close()  # server full or restarting: retry like a refused connect
                    last = e
                except BaseException:
                    sock.close()
                    raise
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DistNetworkError(
                    f"could not connect to the store at {self._where} after {attempts} attempts "
                    f"in {time.monotonic() - started:.1f}s (last error: {last!r}); is the server "
                    "up and the address right?",
                    store=self._where, host=self._host, port=self._port, attempts=attempts,
                    elapsed=time.monotonic() - started,
                )
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _MAX_BACKOFF_S)

    def _handshake(self, sock: socket.socket, join: bool, deadline: float) -> _ClientConn:
        rank = self._rank if join and self._rank is not None else -1
        # Without a token the handshake proves the host secret; later connections reuse it.
        self._token = P.client_handshake(sock, self._token, join, rank, deadline, self._where,
                                         probe_torch=P.under_torchrun())
        conn = _ClientConn(sock)
        with self._conns_lock:
            self._conns.add(conn)
        self._ever_connected = True
        return conn

    # -- request/response -------------------------------------------------------
    @property
    def _where(self) -> str:
        return f"{self._host}:{self._port}"

    def _conn(self) -> _ClientConn:
        if self._closed:
            raise DistStoreError(f"{self!r} is closed", store=self._where)
        if self._lost is not None:
            raise DistStoreError(self._lost, store=self._where)
        conn: _ClientConn | None = getattr(self._local, "conn", None)
        if conn is None or conn.pid != os.getpid():
            conn = self._local.conn = self._connect(join=False)
        return conn

    def _call(
        self, op: P.Op, args: list[bytes], wait_s: float | None = None,
        keys: list[str] | None = None
    ) -> list[bytes]:
        """One request/response; ``wait_s`` marks a parkable request (get/wait) on ``keys``."""
        conn = self._conn()
        started = time.monotonic()
        limit = self._timeout_s if wait_s is None else wait_s
        reply: tuple[int, list[bytes]] | None = None
        try:
            conn.sock.settimeout(max(self._timeout_s, 0.01))
            conn.sock.sendall(P.encode_frame(op, args))
            reply = P.read_frame(conn.sock, started + limit, self._where)
        except P.DeadlinePassed as e:
            if wait_s is None or e.mid_frame:
                self._discard(conn)
                raise DistStoreError(
                    f"store at {self._where} did not answer {op.name} within {limit:g}s",
                    store=self._where, op=op.name,
                ) from None
        except TimeoutError:  # sendall could not finish: the server stopped reading
            self._discard(conn)
            raise DistStoreError(
                f"store at {self._where} stopped accepting requests ({op.name})", store=self._where
            ) from None
        except (P.ConnectionLost, OSError) as e:
            self._discard(conn)
            raise self._connection_lost(e) from None
        except BaseException:  # e.g. KeyboardInterrupt mid-request: the stream is out of step
            self._discard(conn)
            raise
        if reply is None:  # a get/wait passed its deadline
            reply = self._cancel(conn, keys or [], started, limit, op)
        return self._result(*reply)

    def _cancel(
        self, conn: _ClientConn, keys: list[str], started: float, limit: float, op: P.Op
    ) -> tuple[int, list[bytes]]:
        # The wait timed out; withdraw it so the same connection stays usable (S4).
        grace = time.monotonic() + _CANCEL_GRACE_S
        try:
            conn.sock.settimeout(_CANCEL_GRACE_S)
            conn.sock.sendall(P.encode_frame(P.Op.CANCEL, []))
            status, out = P.read_frame(conn.sock, grace, self._where)
            if status != P.Status.CANCELED:  # the reply won the race: it is still valid
                P.read_frame(conn.sock, grace, self._where)
                return status, out
        except (P.DeadlinePassed, P.ConnectionLost, OSError, DistStoreError):
            self._discard(conn)
        name = {P.Op.MULTI_GET: "get", P.Op.QUEUE_POP: "queue_pop"}.get(op, "wait")
        raise timeout_error(keys, f"TCPStore {self._where}", started, limit, name)

    def _result(self, status: int, out: list[bytes]) -> list[bytes]:
        if status == P.Status.OK:
            return out
        message = out[0].decode("utf-8", "replace") if out else "no detail"
        if status == P.Status.VALUE_ERROR:
            raise ValueError(message)
        if status == P.Status.QUEUE_EMPTY:
            raise QueueEmptyError(message, store=self._where)
        raise DistStoreError(f"store at {self._where}: {message}", store=self._where)

    def _discard(self, conn: _ClientConn) -> None:
        conn.close()
        if getattr(self._local, "conn", None) is conn:
            self._local.conn = None

    def _connection_lost(self, cause: BaseException) -> DistStoreError:
        if self._closed:
            return DistStoreError(f"{self!r} was closed", store=self._where)
        self._lost = (
            f"store connection lost ({self._where}) — server shut down or crashed ({cause}); "
            "a store op cannot complete without it"
        )
        return DistStoreError(self._lost, store=self._where)

    @staticmethod
    def _k(key: str) -> bytes:
        raw = check_key(key).encode("utf-8")
        if len(raw) > P.MAX_KEY_BYTES:
            raise ValueError(f"store key: expected at most {P.MAX_KEY_BYTES} bytes, got {len(raw)}")
        return raw

    @staticmethod
    def _v(value: str | bytes) -> bytes:
        raw = to_bytes(value)
        if len(raw) > P.MAX_VALUE_BYTES:
            raise ValueError(
                f"store value: expected at most {P.MAX_VALUE_BYTES} bytes, got {len(raw)}"
            )
        return raw

    # -- the Store interface -------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        self._call(P.Op.SET, [self._k(key), self._v(value)])

    def get(self, key: str) -> bytes:
        return self._call(P.Op.MULTI_GET, [self._k(key)], self._timeout_s, [key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = check_keys(keys)
        raw, out = [self._k(k) for k in keys], []
        deadline = time.monotonic() + self._timeout_s
        for lo, hi in P.split_args(raw, 1):
            wait_s = max(deadline - time.monotonic(), 0.001)   # one deadline for all batches
            out += self._call(P.Op.MULTI_GET, raw[lo:hi], wait_s, keys[lo:hi])
        return out

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        keys, raw = check_pairs(keys, values)
        args = [x for k, v in zip(keys, raw, strict=True) for x in (self._k(k), self._v(v))]
        for lo, hi in P.split_args(args, 2):   # atomic per batch of up to MAX_ARGS / 2 keys
            self._call(P.Op.MULTI_SET, args[2 * lo : 2 * hi])

    def add(self, key: str, amount: int) -> int:
        return int(self._call(P.Op.ADD, [self._k(key), str(int(amount)).encode()])[0])

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        args = [self._k(key), to_bytes(expected_value), self._v(desired_value)]
        return self._call(P.Op.COMPARE_SET, args)[0]

    def append(self, key: str, value: str | bytes) -> None:
        self._call(P.Op.APPEND, [self._k(key), self._v(value)])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = check_keys(keys)
        raw, deadline = [self._k(k) for k in keys], time.monotonic() + self._wait_seconds(timeout)
        for lo, hi in P.split_args(raw, 1):
            wait_s = max(deadline - time.monotonic(), 0.001)
            self._call(P.Op.WAIT, raw[lo:hi], wait_s, keys[lo:hi])

    def check(self, keys: list[str]) -> bool:
        raw = [self._k(k) for k in check_keys(keys)]
        return all(self._call(P.Op.CHECK, raw[lo:hi])[0] == b"1" for lo, hi in P.split_args(raw, 1))

    def delete_key(self, key: str) -> bool:
        return self._call(P.Op.DELETE, [self._k(key)])[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(P.Op.NUM_KEYS, [])[0])

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._call(P.Op.QUEUE_PUSH, [self._k(key), self._v(value)])

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        if block:   # parked by the server until a value arrives, like get
            return self._call(P.Op.QUEUE_POP, [self._k(key), b"1"], self._timeout_s, [key])[0]
        try:
            return self._call(P.Op.QUEUE_POP, [self._k(key), b"0"])[0]
        except QueueEmptyError:
            raise queue_empty_error(key, f"TCPStore {self._where}") from None

    def queue_len(self, key: str) -> int:
        return int(self._call(P.Op.QUEUE_LEN, [self._k(key)])[0])

    def list_keys(self) -> list[str]:
        return [k.decode("utf-8") for k in self._call(P.Op.LIST_KEYS, [])]

    # -- identity and lifetime -----------------------------------------------------
    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def libuvBackend(self) -> bool:
        return False

    def __repr__(self) -> str:
        role = "master" if self._is_master else "client"
        state = " closed" if self._closed else (" lost" if self._lost else "")
        return (
            f"TCPStore({self._where}, {role}, world_size={self._world_size}, "
            f"timeout={self._timeout_s:g}s{state})"
        )

    def close(self) -> None:
        """Close this instance's connections; on the master also stop the server.

        Clients blocked on this store get "store connection lost" errors. Idempotent.
        """
        self._closed = True
        with self._conns_lock:
            conns = list(self._conns)
            self._conns.clear()
        for conn in conns:
            conn.close()
        server, self._server = self._server, None
        if server is not None:
            release_server(server)

    shutdown = close

    def __del__(self) -> None:
        # Best effort at interpreter exit or GC: never raise from a finalizer.
        with contextlib.suppress(Exception):
            if not getattr(self, "_closed", True):
                self.close()


def effective_token(store: Store) -> bytes | None:
    """The secret a store's clients proved: its run token or host secret (None for other stores).

    The tcp transport keys its connection handshake with it, so that only processes that could
    authenticate to the store can join the mesh.  ``PrefixStore`` layers are looked through.
    """
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store._token if isinstance(store, TCPStore) else None


def _validate(host: object, port: object, world_size: object, is_master: bool) -> None:
    if not isinstance(host, str):
        raise TypeError(f"TCPStore host_name: expected str, got {type(host).__name__}")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"TCPStore port: expected an int in [0, 65535], got {port!r}")
    if port == 0 and not is_master:
        raise ValueError("TCPStore port: expected the server's port on a client, got 0")
    if world_size is not None and (
        not isinstance(world_size, int) or world_size == 0 or world_size < -1
    ):
        raise ValueError("TCPStore world_size: expected a positive int or None, got "
                         f"{world_size!r}")
