"""Tests of ringlet.store: semantics on every store type, then the failure matrix
(docs/reliability.md, rows S1-S4, S6, S7): timeouts, signals, bind/connect failures, a killed
server, hostile clients, missing workers, FileStore misuse."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from ringlet.errors import DistError, DistNetworkError, DistStoreError, QueueEmptyError
from ringlet.store import FileStore, HashStore, PrefixStore, Store, TCPStore
from ringlet.store import _protocol as P
from ringlet.store import _table as KT

pytestmark = pytest.mark.timeout(30)  # backstop; tests that wait carry tighter marks

REPO = Path(__file__).resolve().parents[1]
T = 0.2  # the short timeout of S4
SHORT = timedelta(seconds=5)  # deadline of ops that must succeed


# -- helpers -------------------------------------------------------------------------
def _master(**kw: object) -> TCPStore:
    kw.setdefault("wait_for_workers", False)
    kw.setdefault("timeout", SHORT)
    return TCPStore("127.0.0.1", 0, is_master=True, **kw)  # type: ignore[arg-type]


# Children die with the test process (PR_SET_PDEATHSIG = 1), set first thing in the child.
_PRELUDE = "import ctypes, signal; ctypes.CDLL('libc.so.6').prctl(1, signal.SIGKILL)\n"


@contextlib.contextmanager
def _child(code: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A Python child running ``code``; always killed and reaped."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-c", _PRELUDE + code, *args], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=env,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=5)


def _raw_connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=2)
    sock.settimeout(2)
    return sock


def _read_until_closed(sock: socket.socket, limit_s: float = 2.0) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    data, deadline = b"", time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(4096)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    raise AssertionError(f"server kept the connection open for {limit_s}s")


def _authed_raw(port: int, token: bytes | None) -> socket.socket:
    """A raw connection that completed the handshake (to send hostile frames after it)."""
    sock = _raw_connect(port)
    hello = P.recv_exact(sock, P.SERVER_HELLO.size, time.monotonic() + 2)
    nonce = P.SERVER_HELLO.unpack(hello)[3]
    mac = P.token_mac(token, nonce) if token else bytes(32)
    sock.sendall(P.CLIENT_HELLO.pack(P.MAGIC, P.VERSION, P.CLIENT_HAS_MAC, mac, -1))
    assert P.recv_exact(sock, 1, time.monotonic() + 2) == bytes([P.HS_OK])
    return sock


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture(autouse=True)
def _no_leaks() -> Iterator[None]:
    """Leak audit (H1): no server thread and no file descriptor outlives a test."""
    before = _open_fds()
    yield
    deadline = time.monotonic() + 3
    while True:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("ringlet-store")]
        fds = _open_fds()
        if not alive and fds <= before:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaked: server threads {alive}, {fds - before} fds")
        gc.collect()  # a finished thread's connection closes when its objects are collected
        time.sleep(0.02)


StoreMaker = Callable[[], Store]


@pytest.fixture(params=["hash", "file", "tcp", "tcp-client", "prefix"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreMaker]:
    """Builds fresh stores of one kind; closes them all afterwards."""
    opened: list[Store] = []

    def make() -> Store:
        store: Store
        if request.param == "hash":
            store = HashStore(timeout=SHORT)
        elif request.param == "file":
            store = FileStore(str(tmp_path / f"store{len(opened)}"), timeout=SHORT)
        elif request.param == "tcp":
            store = _master()
        elif request.param == "tcp-client":
            opened.append(server := _master())
            store = TCPStore("127.0.0.1", server.port, timeout=SHORT)
        else:
            store = PrefixStore("pfx", HashStore(timeout=SHORT))
        opened.append(store)
        return store

    yield make
    for store in opened:
        if isinstance(store, TCPStore | FileStore):
            store.close()


# -- semantics on every store --------------------------------------------------------
@pytest.mark.timeout(10)
def test_basic_ops(make_store: StoreMaker) -> None:
    store = make_store()
    store.set("a", "héllo")
    store.set("b", b"\x00\xff")
    assert store.get("a") == "héllo".encode()
    assert store.get("b") == b"\x00\xff"
    assert store.check(["a", "b"]) and not store.check(["a", "zz"])
    assert store.num_keys() == 2
    store.multi_set(["m1", "m2"], ["1", b"2"])
    assert store.multi_get(["m2", "m1"]) == [b"2", b"1"]
    store.append("ap", "x")
    store.append("ap", b"y")
    assert store.get("ap") == b"xy"
    assert store.delete_key("a") and not store.delete_key("a")
    assert not store.check(["a"])
    store.wait(["b", "m1"])
    store.wait(["b"], timedelta(seconds=1))
    assert store.num_keys() == 4
    with pytest.raises(TypeError):
        store.set("k", 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected as many values"):
        store.multi_set(["x", "y"], ["1"])


@pytest.mark.timeout(60)
def test_more_keys_than_one_frame_holds(make_store: StoreMaker) -> None:
    # 70000 keys exceed the 65536 arguments of one TCPStore frame: the client splits them.
    store = make_store()
    keys = [f"k{i}" for i in range(70000)]
    store.multi_set(keys, [str(i) for i in range(70000)])
    got = store.multi_get(keys)
    assert len(got) == 70000 and got[0] == b"0" and got[-1] == b"69999" and got[65536] == b"65536"
    assert store.check(keys) and not store.check([*keys, "absent"])
    store.wait(keys, timedelta(seconds=30))
    assert store.get("k69999") == b"69999"


def test_requests_split_by_argument_count_and_bytes() -> None:
    big = b"x" * (40 << 20)   # two 40 MiB values cannot share one 65 MiB request
    assert P.split_args([b"a", big, b"b", big], 2) == [(0, 1), (1, 2)]
    n = P.MAX_ARGS
    assert P.split_args([b"k"] * (n + 1), 1) == [(0, n), (n, n + 1)]
    assert P.split_args([], 1) == []


@pytest.mark.timeout(10)
def test_add_counters(make_store: StoreMaker) -> None:
    store = make_store()
    assert store.add("c", 3) == 3
    assert store.get("c") == b"3"
    assert store.add("c", -5) == -2
    store.set("n", "12")
    assert store.add("n", 1) == 13
    store.set("bad", "xyz")
    with pytest.raises(ValueError, match="ASCII integer"):
        store.add("bad", 1)
    assert store.get("bad") == b"xyz"  # and the store is still usable


@pytest.mark.timeout(10)
def test_compare_set(make_store: StoreMaker) -> None:
    store = make_store()
    assert store.compare_set("k", "x", "y") == b"x"  # missing, expected not empty: unchanged
    assert not store.check(["k"])
    assert store.compare_set("k", "", "y") == b"y"  # missing, expected empty: set
    assert store.compare_set("k", "z", "w") == b"y"  # mismatch: current value
    assert store.compare_set("k", b"y", b"w") == b"w"  # match: set
    assert store.get("k") == b"w"


@pytest.mark.timeout(10)
def test_timeout_then_reusable(make_store: StoreMaker) -> None:
    store = make_store()
    store.set_timeout(timedelta(seconds=T))
    assert store.timeout == timedelta(seconds=T)
    conn = store._local.conn if isinstance(store, TCPStore) else None
    for call in (lambda: store.get("nokey"), lambda: store.wait(["nokey", "other"])):
        started = time.monotonic()
        with pytest.raises(DistStoreError, match="nokey") as info:
            call()
        elapsed = time.monotonic() - started
        assert T <= elapsed < T + 0.5, elapsed
        assert "timed out after" in str(info.value) and "Store" in str(info.value)
    started = time.monotonic()
    with pytest.raises(DistStoreError):
        store.wait(["nokey"], timedelta(seconds=0.1))
    assert 0.1 <= time.monotonic() - started < 0.6
    store.set("nokey", "v")  # the same client keeps working
    assert store.get("nokey") == b"v"
    store.wait(["nokey"])
    if isinstance(store, TCPStore):
        assert store._local.conn is conn  # ... on the very same connection (S4)


@pytest.mark.timeout(10)
def test_signal_neither_aborts_nor_shortens_wait(make_store: StoreMaker) -> None:
    store = make_store()
    hits: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: hits.append(signum))
    stop = threading.Event()
    main = threading.main_thread().ident
    assert main is not None

    def pester() -> None:
        while not stop.wait(0.05):
            signal.pthread_kill(main, signal.SIGUSR1)

    pester_thread = threading.Thread(target=pester)
    pester_thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(DistStoreError, match="never"):
            store.wait(["never"], timedelta(seconds=0.4))
        assert time.monotonic() - started >= 0.4
        threading.Timer(0.2, store.set, ("late", "v")).start()
        assert store.get("late") == b"v"  # a wait that signals interrupt still completes
    finally:
        stop.set()
        pester_thread.join(5)
        signal.signal(signal.SIGUSR1, old)
    assert len(hits) >= 4


@pytest.mark.timeout(10)
def test_blocked_get_does_not_block_other_threads(make_store: StoreMaker) -> None:
    store = make_store()
    got: list[bytes] = []
    waiter = threading.Thread(target=lambda: got.append(store.get("k")))
    waiter.start()
    time.sleep(0.1)
    started = time.monotonic()
    store.set("other", "1")
    assert store.add("ctr", 1) == 1
    assert time.monotonic() - started < 0.5
    store.set("k", "v")
    waiter.join(5)
    assert got == [b"v"]


def test_prefix_store_isolation() -> None:
    base = HashStore(timeout=SHORT)
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.set("x", "1")
    b.set("x", "2")
    assert (a.get("x"), b.get("x"), base.get("a/x")) == (b"1", b"2", b"1")
    assert not a.check(["y"]) and a.underlying_store is base
    nested = PrefixStore("inner", a)
    nested.set("z", "3")
    assert base.get("a/inner/z") == b"3"
    a.set_timeout(timedelta(seconds=T))
    assert base.timeout == timedelta(seconds=T)
    with pytest.raises(DistStoreError, match="a/missing"):
        a.get("missing")
    assert "PrefixStore('a'" in repr(a)


# -- TCPStore: bind, connect, lifetime -------------------------------------------------
@pytest.mark.timeout(10)
def test_port_in_use_fails_fast_naming_errno() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(DistNetworkError) as info:
            TCPStore("127.0.0.1", port, is_master=True, timeout=SHORT)
        assert time.monotonic() - started < 1.0
    message = str(info.value)
    assert "EADDRINUSE" in message and f"127.0.0.1:{port}" in message
    assert info.value.errno == "EADDRINUSE" and info.value.port == port


@pytest.mark.timeout(10)
def test_connect_without_server_times_out_naming_address() -> None:
    with socket.socket() as reserved:  # bound, not listening: the port refuses connections
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(DistNetworkError) as info:
            TCPStore("127.0.0.1", port, timeout=timedelta(seconds=0.5))
        elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 1.5, elapsed
    assert f"127.0.0.1:{port}" in str(info.value) and "attempts" in str(info.value)
    assert info.value.attempts >= 3


@pytest.mark.timeout(10)
def test_late_server_is_accepted_and_listen_fd_used() -> None:
    with socket.socket() as pre:
        pre.bind(("127.0.0.1", 0))
        port = pre.getsockname()[1]
        result: list[object] = []

        def connect() -> None:
            try:
                client = TCPStore("127.0.0.1", port, timeout=SHORT)
                result.append(client.get("hello"))
                client.close()
            except DistError as e:  # reported by the assert below
                result.append(e)

        thread = threading.Thread(target=connect)
        thread.start()
        time.sleep(0.5)  # the client is retrying meanwhile
        server = TCPStore("127.0.0.1", 0, is_master=True, master_listen_fd=pre.fileno(),
                          wait_for_workers=False, timeout=SHORT)
        try:
            assert server.port == port
            server.set("hello", "world")
            thread.join(5)
        finally:
            server.close()
    assert result == [b"world"]


@pytest.mark.timeout(10)
def test_server_binds_only_its_host() -> None:
    server = _master()
    try:
        assert repr(server).startswith(f"TCPStore(127.0.0.1:{server.port}, master")
        with pytest.raises(DistNetworkError):  # 127.0.0.2 is loopback too, but not bound
            TCPStore("127.0.0.2", server.port, timeout=timedelta(seconds=0.3))
    finally:
        server.close()


_KILLABLE_MASTER = """
import time
from datetime import timedelta
from ringlet.store import TCPStore
s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
print(s.port, flush=True)
time.sleep(30)
"""


@pytest.mark.timeout(20)
def test_killed_server_fails_blocked_and_later_calls() -> None:
    with _child(_KILLABLE_MASTER) as proc:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        client = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
        try:
            client.set("k", "v")
            errors: list[tuple[float, BaseException]] = []

            def blocked() -> None:
                try:
                    client.get("never")
                except DistError as e:
                    errors.append((time.monotonic(), e))

            waiter = threading.Thread(target=blocked)
            waiter.start()
            time.sleep(0.2)
            killed = time.monotonic()
            proc.kill()
            waiter.join(5)
            assert errors, "the blocked get did not return"
            detected, error = errors[0]
            assert detected - killed < 1.0
            assert isinstance(error, DistStoreError)
            assert f"store connection lost (127.0.0.1:{port})" in str(error)
            started = time.monotonic()
            with pytest.raises(DistStoreError, match="connection lost"):
                client.set("k2", "v")
            assert time.monotonic() - started < 0.5
        finally:
            client.close()


@pytest.mark.timeout(10)
def test_master_close_fails_clients_and_repeats() -> None:
    server = _master()
    client = TCPStore("127.0.0.1", server.port, timeout=SHORT)
    server.close()
    server.close()  # idempotent
    with pytest.raises(DistStoreError, match="connection lost|closed"):
        client.get("x")
    with pytest.raises(DistStoreError, match="closed"):
        server.set("x", "1")
    client.close()


@pytest.mark.timeout(10)
def test_wait_for_workers_names_missing_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")  # the joining client claims its rank from the environment
    with socket.socket() as pre:
        pre.bind(("127.0.0.1", 0))
        pre.listen()
        port = pre.getsockname()[1]
        clients: list[TCPStore] = []
        joiner = threading.Thread(
            target=lambda: clients.append(TCPStore("127.0.0.1", port, 3, timeout=SHORT))
        )
        joiner.start()
        started = time.monotonic()
        with pytest.raises(DistStoreError) as info:
            TCPStore("127.0.0.1", port, 3, True, timedelta(seconds=0.7),
                     master_listen_fd=pre.fileno(), rank=0)
        assert 0.7 <= time.monotonic() - started < 2.0
        joiner.join(5)
        for client in clients:
            client.close()
    assert "2/3 joined" in str(info.value) and "missing ranks [2]" in str(info.value)
    assert info.value.missing_ranks == [2]


@pytest.mark.timeout(10)
def test_wait_for_workers_returns_when_all_joined() -> None:
    with socket.socket() as pre:
        pre.bind(("127.0.0.1", 0))
        pre.listen()
        port = pre.getsockname()[1]
        clients: list[TCPStore] = []
        joiner = threading.Thread(
            target=lambda: clients.append(TCPStore("127.0.0.1", port, 2, timeout=SHORT))
        )
        joiner.start()
        master = TCPStore("127.0.0.1", port, 2, True, SHORT, master_listen_fd=pre.fileno())
        joiner.join(5)
        master.close()
        for client in clients:
            client.close()
    assert len(clients) == 1


def test_multi_tenant_shares_one_server() -> None:
    first = _master(multi_tenant=True)
    second = TCPStore("127.0.0.1", first.port, is_master=True, multi_tenant=True,
                      wait_for_workers=False, timeout=SHORT)
    first.set("k", "v")
    first.close()
    assert second.get("k") == b"v"  # the server lives while a tenant uses it
    second.close()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="port"):
        TCPStore("127.0.0.1", 0)
    with pytest.raises(ValueError, match="world_size"):
        TCPStore("127.0.0.1", 1234, world_size=0)
    server = _master()
    try:
        with pytest.raises(ValueError, match="at most 4096 bytes"):
            server.set("k" * 5000, "v")  # caps are checked before sending
        server.set("k", "still fine")
    finally:
        server.close()


# -- hostile clients (S6) --------------------------------------------------------------
@pytest.fixture
def guarded_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStore]:
    """A master with a run token and a 0.3 s handshake deadline."""
    monkeypatch.setattr(P, "HANDSHAKE_TIMEOUT_S", 0.3)
    server = _master(token=b"secret-run-token")
    yield server
    server.close()


def _assert_healthy(server: TCPStore) -> None:
    client = TCPStore("127.0.0.1", server.port, timeout=SHORT, token=b"secret-run-token")
    try:
        started = time.monotonic()
        client.set("health", "ok")
        assert server.get("health") == b"ok"
        assert time.monotonic() - started < 0.1
    finally:
        client.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "payload",
    [
        os.urandom(512),
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        struct.pack("!Q", 1 << 40) + b"x" * 64,
        P.MAGIC + b"\xff" * 40,  # right magic, then garbage in place of a hello
    ],
    ids=["random", "http", "len2^40", "bad-hello"],
)
def test_garbage_before_handshake_is_dropped(guarded_server: TCPStore, payload: bytes) -> None:
    with _raw_connect(guarded_server.port) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(payload)
        reply = _read_until_closed(sock)
    assert reply[: len(P.MAGIC)] == P.MAGIC  # it only ever saw the server hello
    assert len(reply) <= P.SERVER_HELLO.size + 1
    _assert_healthy(guarded_server)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "frame",
    [
        struct.pack("!Q", 1 << 40),
        struct.pack("!Q", 16) + struct.pack("!BI", P.Op.SET, 1 << 30) + b"\x00" * 11,
        P.encode_frame(99, []),
        P.encode_frame(P.Op.SET, [b"only-a-key"]),
        P.encode_frame(P.Op.SET, [b"k" * (P.MAX_KEY_BYTES + 1), b"v"]),
    ],
    ids=["len2^40", "argc2^30", "unknown-op", "bad-argc", "huge-key"],
)
def test_bad_frames_after_handshake_close_only_that_connection(
    guarded_server: TCPStore, frame: bytes
) -> None:
    with _authed_raw(guarded_server.port, b"secret-run-token") as sock:
        sock.sendall(frame)
        assert _read_until_closed(sock) == b""
    _assert_healthy(guarded_server)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("token", [b"wrong", None])
def test_wrong_or_missing_token_is_refused(
    guarded_server: TCPStore, token: bytes | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RINGLET_STORE_TOKEN", raising=False)
    monkeypatch.delenv("RINGLET_STORE_TOKEN_FILE", raising=False)
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="store refused the connection: bad run token"):
        TCPStore("127.0.0.1", guarded_server.port, timeout=SHORT, token=token)
    assert time.monotonic() - started < 1.0  # refused at once, not retried until timeout
    _assert_healthy(guarded_server)


@pytest.mark.timeout(10)
def test_token_from_environment(guarded_server: TCPStore, monkeypatch: pytest.MonkeyPatch,
                                tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_bytes(b"secret-run-token\n")
    monkeypatch.setenv("RINGLET_STORE_TOKEN_FILE", str(token_file))
    client = TCPStore("127.0.0.1", guarded_server.port, timeout=SHORT)
    client.set("k", "v")
    client.close()


@pytest.mark.timeout(10)
def test_idle_connections_dropped_after_handshake_deadline(guarded_server: TCPStore) -> None:
    socks = [_raw_connect(guarded_server.port) for _ in range(50)]
    try:
        socks[0].sendall(P.MAGIC)  # a slow hello counts as idle too
        started = time.monotonic()
        for sock in socks:
            _read_until_closed(sock)
        assert time.monotonic() - started < 1.5
        _assert_healthy(guarded_server)
    finally:
        for sock in socks:
            sock.close()


def test_frame_reader_and_decoder_check_sizes_first() -> None:
    reader = P.FrameReader(max_frame=1024)
    with pytest.raises(P.ProtocolError, match="exceeds the cap"):
        reader.feed(struct.pack("!Q", 1 << 40))
    frame = P.encode_frame(P.Op.SET, [b"k", b"v"])
    reader = P.FrameReader()
    assert reader.feed(frame[:5]) == [] and len(reader.feed(frame[5:] + frame)) == 2
    with pytest.raises(P.ProtocolError, match="overruns"):
        P.decode_payload(struct.pack("!BI", 1, 1) + struct.pack("!I", 100) + b"ab")
    with pytest.raises(P.ProtocolError, match="arguments"):
        P.decode_payload(struct.pack("!BI", 1, P.MAX_ARGS + 1))


def test_key_table_parks_and_wakes_without_polling() -> None:
    table = KT.KeyTable()
    parked = table.handle("conn", P.Op.MULTI_GET, [b"a", b"b"])
    assert isinstance(parked, KT.Parked)
    table.handle("other", P.Op.SET, [b"a", b"1"])
    assert table.pop_ready() == []
    table.handle("other", P.Op.DELETE, [b"a"])
    table.handle("other", P.Op.SET, [b"b", b"2"])
    assert table.pop_ready() == []  # "a" was deleted meanwhile: still parked
    table.handle("other", P.Op.SET, [b"a", b"3"])
    assert table.pop_ready() == [("conn", (P.Status.OK, [b"3", b"2"]))]
    again = table.handle("conn", P.Op.WAIT, [b"zz"])
    assert isinstance(again, KT.Parked)
    table.cancel(again)
    table.handle("other", P.Op.SET, [b"zz", b"1"])
    assert table.pop_ready() == []


# -- FileStore (S7) -----------------------------------------------------------------------
_FILE_PEER = """
import sys
from datetime import timedelta
from ringlet.store import FileStore
s = FileStore(sys.argv[1], world_size=2, timeout=timedelta(seconds=5))
s.set("child", "here")
assert s.get("parent") == b"here"
s.add("count", 1)
s.close()
"""


@pytest.mark.timeout(15)
def test_file_store_across_processes_removes_file(tmp_path: Path) -> None:
    path = tmp_path / "rdzv"
    with _child(_FILE_PEER, str(path)) as proc:
        store = FileStore(str(path), world_size=2, timeout=SHORT)
        assert store.get("child") == b"here"
        store.set("parent", "here")
        assert proc.wait(10) == 0, proc.communicate()[1]
        assert store.add("count", 1) == 2
        store.close()
    assert not path.exists()  # the last of world_size instances removed it


@pytest.mark.timeout(10)
def test_file_store_rejects_foreign_and_stale_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.write_bytes(b"\x00garbage from something else" * 10)
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="not a ringlet FileStore"):
        FileStore(str(junk), world_size=2, timeout=SHORT)
    assert time.monotonic() - started < 1.0
    stale = tmp_path / "stale"
    crashed = FileStore(str(stale), world_size=1, timeout=SHORT)
    os.close(crashed._fd)  # a process of an earlier run died without close()
    crashed._closed = True
    with pytest.raises(DistStoreError, match="stale file"):
        FileStore(str(stale), world_size=1, timeout=SHORT)
    empty = tmp_path / "empty"
    empty.touch()  # e.g. tempfile.NamedTemporaryFile: a legitimate start
    store = FileStore(str(empty), timeout=SHORT)
    store.set("k", "v")
    assert repr(store).startswith("FileStore(") and store.num_keys() == 1
    store.close()


@pytest.mark.timeout(10)
def test_file_store_unwritable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    started = time.monotonic()
    with pytest.raises(DistStoreError, match=str(blocker / "store")):
        FileStore(str(blocker / "store"))
    assert time.monotonic() - started < 1.0
    if os.geteuid() != 0:  # root ignores directory permissions
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(DistStoreError, match="Permission denied"):
            FileStore(str(locked / "store"))


@pytest.mark.timeout(10)
def test_file_store_deleted_mid_wait(tmp_path: Path) -> None:
    path = tmp_path / "store"
    store = FileStore(str(path), timeout=SHORT)
    threading.Timer(0.2, os.remove, (path,)).start()
    started = time.monotonic()
    with pytest.raises(DistStoreError, match="deleted or replaced"):
        store.get("never")
    assert time.monotonic() - started < 1.0
    store.close()


@pytest.mark.timeout(10)
def test_connection_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(P, "MAX_CONNECTIONS", 3)
    server = _master()  # its own client is connection 1
    try:
        idle = [_raw_connect(server.port) for _ in range(2)]
        with _raw_connect(server.port) as refused:
            assert _read_until_closed(refused) == b""  # closed at once, no hello
        for sock in idle:
            sock.close()
        time.sleep(0.1)
        _assert_healthy_plain(server)
    finally:
        server.close()


def _assert_healthy_plain(server: TCPStore) -> None:
    client = TCPStore("127.0.0.1", server.port, timeout=SHORT)
    client.set("x", "1")
    assert server.get("x") == b"1"
    client.close()


@pytest.mark.timeout(10)
def test_concurrent_adds_are_atomic(make_store: StoreMaker) -> None:
    store = make_store()
    threads = [threading.Thread(target=lambda: [store.add("n", 1) for _ in range(50)])
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(5)
    assert store.get("n") == b"200"


@pytest.mark.timeout(10)
def test_large_values_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    server = _master()
    client = TCPStore("127.0.0.1", server.port, timeout=SHORT)
    try:
        blob = os.urandom(16 << 20)
        client.set("blob", blob)
        assert server.get("blob") == blob
        assert client.multi_get(["blob", "blob"]) == [blob, blob]
        monkeypatch.setattr(P, "MAX_VALUE_BYTES", 1 << 20)
        with pytest.raises(ValueError, match="at most"):
            client.set("huge", bytes((1 << 20) + 1))  # refused before sending
        client.set("fits", bytes(1 << 20))
    finally:
        client.close()
        server.close()


@pytest.mark.timeout(10)
def test_new_thread_after_server_death_fails_fast() -> None:
    server = _master()
    client = TCPStore("127.0.0.1", server.port, timeout=SHORT)
    server.close()
    errors: list[BaseException] = []

    def fresh_thread() -> None:
        try:
            client.set("k", "v")
        except DistError as e:
            errors.append(e)

    started = time.monotonic()
    thread = threading.Thread(target=fresh_thread)
    thread.start()
    thread.join(5)
    assert time.monotonic() - started < 1.0
    assert errors and "connection lost" in str(errors[0])
    client.close()


@pytest.mark.timeout(10)
def test_unresolvable_host_retries_then_names_it() -> None:
    started = time.monotonic()
    with pytest.raises(DistNetworkError, match="dnsnotexist:1234"):
        TCPStore("dnsnotexist", 1234, timeout=timedelta(seconds=0.3))
    assert 0.3 <= time.monotonic() - started < 3.0
    with pytest.raises(DistNetworkError, match="cannot resolve"):
        TCPStore("dnsnotexist", 0, is_master=True, timeout=SHORT)


@pytest.mark.timeout(30)
def test_semantics_match_torch_hash_store() -> None:
    dist = pytest.importorskip("torch.distributed")
    ours, theirs = HashStore(timeout=SHORT), dist.HashStore()
    script: list[tuple[str, tuple[object, ...]]] = [
        ("compare_set", ("k", "x", "y")), ("check", (["k"],)), ("compare_set", ("k", "", "y")),
        ("compare_set", ("k", "z", "w")), ("compare_set", ("k", "y", "w")), ("get", ("k",)),
        ("add", ("c", 3)), ("add", ("c", -5)), ("get", ("c",)), ("set", ("n", "12")),
        ("add", ("n", 1)), ("append", ("ap", "x")), ("append", ("ap", b"y")), ("get", ("ap",)),
        ("num_keys", ()), ("delete_key", ("ap",)), ("delete_key", ("ap",)), ("num_keys", ()),
        ("multi_set", (["p", "q"], ["1", b"2"])), ("multi_get", (["q", "p"],)),
        ("check", (["p", "nope"],)),
    ]
    for name, args in script:
        assert getattr(ours, name)(*args) == getattr(theirs, name)(*args), (name, args)


class _Interrupt(Exception):
    pass


@pytest.mark.timeout(10)
def test_exception_from_signal_handler_leaves_store_usable(make_store: StoreMaker) -> None:
    store = make_store()

    def handler(signum: int, frame: object) -> None:
        raise _Interrupt

    old = signal.signal(signal.SIGUSR1, handler)
    main = threading.main_thread().ident
    assert main is not None
    try:
        threading.Timer(0.1, signal.pthread_kill, (main, signal.SIGUSR1)).start()
        with pytest.raises(_Interrupt):  # like Ctrl-C during a rendezvous wait
            store.get("never")
    finally:
        signal.signal(signal.SIGUSR1, old)
    store.set("after", "1")
    assert store.get("after") == b"1"


# -- queues, list_keys, clone (torch's Store surface) -------------------------------------------
@pytest.mark.timeout(15)
def test_queue_semantics(make_store: StoreMaker) -> None:
    store = make_store()
    assert store.queue_len("q") == 0 and not store.check(["q"])
    with pytest.raises(QueueEmptyError, match="queue is empty"):
        store.queue_pop("q", block=False)
    store.queue_push("q", "a")
    store.queue_push("q", b"b")
    assert store.queue_len("q") == 2 and store.check(["q"])
    store.wait(["q"], timedelta(seconds=1))            # a non-empty queue counts for wait/check
    store.set("k", "v")
    assert sorted(store.list_keys()) == ["k"]         # queues are not keys
    assert store.delete_key("q") is False and store.queue_len("q") == 2
    assert store.queue_pop("q") == b"a" and store.queue_pop("q", block=False) == b"b"
    assert store.queue_len("q") == 0 and not store.check(["q"])
    store.set("sk", "x")                              # keys are not queues
    assert store.queue_len("sk") == 0
    with pytest.raises(QueueEmptyError):
        store.queue_pop("sk", block=False)
    store.set_timeout(timedelta(seconds=T))
    started = time.monotonic()
    with pytest.raises(DistStoreError,
                       match=r"queue_pop for keys \['(pfx/)?q'\] timed out") as info:
        store.queue_pop("q")
    assert not isinstance(info.value, QueueEmptyError)
    assert T <= time.monotonic() - started < T + 0.5
    store.queue_push("q", "after")                    # usable after a timed-out pop
    assert store.queue_pop("q") == b"after"


@pytest.mark.timeout(15)
def test_blocking_pop_woken_by_push_from_a_clone(make_store: StoreMaker) -> None:
    store = make_store()
    twin = store.clone()
    try:
        assert type(twin) is type(store) and twin is not store
        store.set("shared", "1")
        assert twin.get("shared") == b"1" and "shared" in twin.list_keys()
        threading.Timer(0.2, twin.queue_push, ("jobs", "j1")).start()
        started = time.monotonic()
        assert store.queue_pop("jobs") == b"j1"
        assert 0.1 < time.monotonic() - started < 3
    finally:
        if isinstance(twin, TCPStore | FileStore):
            twin.close()
        elif isinstance(twin,
                        PrefixStore) and isinstance(twin.underlying_store, TCPStore | FileStore):
            twin.underlying_store.close()


def test_prefix_store_queues_and_keys_stay_in_their_namespace() -> None:
    base = HashStore(timeout=SHORT)
    a, b = PrefixStore("a", base), PrefixStore("b", base)
    a.queue_push("q", "1")
    a.set("k", "v")
    assert b.queue_len("q") == 0 and base.queue_len("a/q") == 1
    assert a.list_keys() == ["k"] and b.list_keys() == [] and base.list_keys() == ["a/k"]
    assert a.clone().queue_pop("q") == b"1"


def test_clone_of_the_master_does_not_own_the_server() -> None:
    master = _master()
    twin = master.clone()
    twin.close()                                      # closing a clone leaves the server up
    master.set("still", "up")
    assert master.get("still") == b"up"
    master.close()


def test_queue_errors_are_torchs_names() -> None:
    import ringlet.distributed as rdist

    assert issubclass(rdist.QueueEmptyError, rdist.DistStoreError)
    assert rdist.QueueEmptyError is QueueEmptyError


_CONSUMER = """
import json, sys
from datetime import timedelta
from ringlet.store import FileStore, TCPStore
kind, where, me = sys.argv[1], sys.argv[2], sys.argv[3]
if kind == "tcp":
    store = TCPStore("127.0.0.1", int(where), timeout=timedelta(seconds=10))
else:
    store = FileStore(where, timeout=timedelta(seconds=10))
store.queue_push("ready", me)
got = []
while True:
    item = store.queue_pop("jobs")          # blocks until the producer pushes
    if item == b"stop":
        break
    got.append(item.decode())
store.set(f"done/{me}", json.dumps(got))
store.close()
"""


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["tcp", "file"])
def test_queue_across_processes_delivers_each_item_once(kind: str, tmp_path: Path) -> None:
    """Two consumer processes block in queue_pop; the producer's items reach exactly one each."""
    server: Store
    if kind == "tcp":
        server = _master()
        where = str(server.port)
    else:
        where = str(tmp_path / "queue-store")
        server = FileStore(where, timeout=SHORT)
    try:
        with _child(_CONSUMER, kind, where, "c0") as c0, _child(_CONSUMER, kind, where, "c1") as c1:
            ready = {server.queue_pop("ready"), server.queue_pop("ready")}
            assert ready == {b"c0", b"c1"}
            items = [f"item{i}" for i in range(20)]
            for item in items:
                server.queue_push("jobs", item)
            for _ in range(2):
                server.queue_push("jobs", "stop")
            server.wait(["done/c0", "done/c1"], timedelta(seconds=20))
            got = [json.loads(server.get(f"done/{c}")) for c in ("c0", "c1")]
            assert c0.wait(10) == 0 and c1.wait(10) == 0
        assert sorted(got[0] + got[1]) == sorted(items)
        assert server.queue_len("jobs") == 0
    finally:
        server.close()  # type: ignore[attr-defined]


@pytest.mark.timeout(30)
def test_queue_semantics_match_torch_hash_store() -> None:
    dist = pytest.importorskip("torch.distributed")
    ours, theirs = HashStore(timeout=SHORT), dist.HashStore()
    script: list[tuple[str, tuple[object, ...]]] = [
        ("queue_len", ("q",)), ("check", (["q"],)), ("queue_push", ("q", "a")),
        ("queue_push", ("q", b"b")), ("queue_len", ("q",)), ("check", (["q"],)),
        ("num_keys", ()), ("list_keys", ()), ("set", ("k", "v")), ("list_keys", ()),
        ("delete_key", ("q",)), ("queue_pop", ("q",)), ("queue_pop", ("q", False)),
        ("check", (["q"],)), ("queue_len", ("q",)), ("queue_len", ("k",)),
    ]
    for name, args in script:
        assert getattr(ours, name)(*args) == getattr(theirs, name)(*args), (name, args)
    for store in (ours, theirs):
        with pytest.raises(Exception) as info:
            store.queue_pop("q", False)
        assert type(info.value).__name__ == "QueueEmptyError"


def test_a_reply_begun_before_the_deadline_is_read_to_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reply's length arrives before the client's deadline and its payload after it (a
    parked wait answered just as it expires, a client descheduled between its two reads): the
    reply is returned, not reported as a store that stopped answering.  A frame that never
    finishes still fails, as a frame cut mid-way."""
    frame = P.encode_frame(P.Status.OK, [b"value"])
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame[:P.FRAME_LEN.size])
        late = threading.Timer(0.3, a.sendall, (frame[P.FRAME_LEN.size:],))
        late.start()
        try:
            assert P.read_frame(b, time.monotonic() + 0.1, "test") == (P.Status.OK, [b"value"])
        finally:
            late.join(5)
    monkeypatch.setattr(P, "FRAME_REST_S", 0.2)
    c, d = socket.socketpair()
    with c, d:
        c.sendall(frame[:P.FRAME_LEN.size + 2])      # and nothing more
        with pytest.raises(P.DeadlinePassed) as cut:
            P.read_frame(d, time.monotonic() + 0.05, "test")
        assert cut.value.mid_frame
