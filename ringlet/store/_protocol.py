"""TCPStore wire protocol: handshake, frames, size caps.

[Note: store protocol]
1. On accept the server sends ``SERVER_HELLO``: magic, version, flags (token
   required? a host secret?), a 32-byte random nonce and, for a host secret, the id
   of its file ([Note: host secret] in ``_secret``).
2. The client answers with a fixed-size ``CLIENT_HELLO``: magic, version, flags
   (MAC present, counts as a participant), ``HMAC-SHA256(token, nonce)`` and the
   rank it claims (-1: none); a client without a token proves the host secret
   instead. Fixed sizes mean nothing an unauthenticated peer sends can make the
   server allocate; a peer that has not finished within the handshake deadline is
   dropped (anti-slowloris), and at most ``MAX_PENDING`` connections may be waiting
   in their handshake (the oldest is dropped for a new one), so idle or garbage
   connections can never delay authenticated clients.
3. The server answers one status byte (``HS_OK`` or a refusal, then closes).
4. Then requests and responses are frames: ``!Q`` payload length, then payload =
   ``!BI`` (op or status, argc) and argc ``!I``-length-prefixed byte strings.
   Lengths are checked against the caps below *before* any buffer is allocated.
One request is outstanding per connection; ``MULTI_GET``/``WAIT``/``QUEUE_POP`` may be parked by
the server until their keys exist, and the only request allowed while parked is
``CANCEL`` (the client's deadline passed), answered with ``CANCELED`` after any
reply already in flight, so the connection stays usable after a timeout (S4).

torch's TCPStore speaks the other way round: its client talks first (``TORCH_HELLO``), its
server waits.  A ringlet server that reads torch's hello logs once that a torch.distributed
program reached it and drops the connection; a ringlet client started by torchrun that gets no
greeting within ``GREETING_PROBE_S`` sends torch's ping and, when it is echoed, raises an error
that says the program is under the wrong launcher (``TORCH_MIXUP``).  A request of more
arguments or bytes than one frame may hold is split by the client (``split_args``).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import socket
import struct
import time

from ringlet import _env
from ringlet.errors import DistNetworkError, DistStoreError
from ringlet.store._secret import read_secret

MAGIC = b"RNGLSTOR"
VERSION = 2     # 2: the greeting names the host secret
MAX_KEY_BYTES = 4 << 10  # 4 KiB: sizes are capped before allocating (docs/reliability.md, row X3)
MAX_VALUE_BYTES = 64 << 20  # 64 MiB per value
MAX_ARGS = 1 << 16  # keys of one multi_get/multi_set
MAX_REQUEST_BYTES = MAX_VALUE_BYTES + (1 << 20)  # one value plus room for keys and headers
MAX_RESPONSE_BYTES = 1 << 34  # a multi_get may return many values; the server is trusted
MAX_KEYS = 1 << 22  # keys per store (per job)
MAX_CONNECTIONS = 4096
MAX_PENDING = 256  # connections still in their handshake; the oldest goes when a new one comes
TORCH_HELLO = b"\x00" + struct.pack("<I", 0x3C85F7CE)  # torch's TCPStore client speaks first: this
GREETING_PROBE_S = 2.0  # under torchrun: no greeting this long -> ask whether torch's store answers
HANDSHAKE_TIMEOUT_S = 5.0  # an unauthenticated connection is dropped after this

# Handshake flags.
SERVER_NEEDS_TOKEN = 1
SERVER_HOST_SECRET = 2  # the token is the host secret named in the greeting
CLIENT_HAS_MAC = 1
CLIENT_JOINS = 2  # this connection is a participant (counts towards world_size)

SERVER_HELLO = struct.Struct("!8sHH32s24s")  # ..., nonce, host secret id (NUL-padded)
CLIENT_HELLO = struct.Struct("!8sHH32si")
HS_OK, HS_BAD_TOKEN, HS_BAD_VERSION = 0, 1, 2

FRAME_LEN = struct.Struct("!Q")
PAYLOAD_HEAD = struct.Struct("!BI")
ARG_LEN = struct.Struct("!I")


class Op(enum.IntEnum):
    SET = 1
    MULTI_GET = 2  # parks until every key exists
    ADD = 3
    COMPARE_SET = 4
    WAIT = 5  # parks until every key exists
    CHECK = 6
    DELETE = 7
    NUM_KEYS = 8
    MULTI_SET = 9
    APPEND = 10
    CANCEL = 11  # the client gave up on its parked request
    PING = 12
    QUEUE_PUSH = 13
    QUEUE_POP = 14  # args: key, b"1" (block: parks until the queue has a value) or b"0"
    QUEUE_LEN = 15
    LIST_KEYS = 16


class Status(enum.IntEnum):
    OK = 0
    ERROR = 1  # a DistStoreError on the client
    VALUE_ERROR = 2  # a ValueError on the client (e.g. add on a non-integer)
    CANCELED = 3
    QUEUE_EMPTY = 4  # a QueueEmptyError on the client


class ProtocolError(Exception):
    """The peer broke the protocol; the connection is closed."""


def token_mac(token: bytes, nonce: bytes) -> bytes:
    return hmac.new(token, nonce, hashlib.sha256).digest()


def encode_frame(code: int, args: list[bytes]) -> bytes:
    parts = [PAYLOAD_HEAD.pack(code, len(args))]
    for arg in args:
        parts.append(ARG_LEN.pack(len(arg)))
        parts.append(arg)
    payload_len = sum(len(p) for p in parts)
    return FRAME_LEN.pack(payload_len) + b"".join(parts)


def decode_payload(payload: bytes | bytearray | memoryview) -> tuple[int, list[bytes]]:
    """Split a frame payload into (code, args); every length is checked against what remains."""
    view = memoryview(payload)
    if len(view) < PAYLOAD_HEAD.size:
        raise ProtocolError(f"frame of {len(view)} bytes is shorter than its header")
    code, argc = PAYLOAD_HEAD.unpack_from(view)
    if argc > MAX_ARGS:
        raise ProtocolError(f"frame claims {argc} arguments, at most {MAX_ARGS} allowed")
    pos, args = PAYLOAD_HEAD.size, []
    for _ in range(argc):
        if pos + ARG_LEN.size > len(view):
            raise ProtocolError("frame truncated inside an argument header")
        (n,) = ARG_LEN.unpack_from(view, pos)
        pos += ARG_LEN.size
        if n > len(view) - pos:
            raise ProtocolError(f"argument of {n} bytes overruns its frame")
        args.append(bytes(view[pos : pos + n]))
        pos += n
    if pos != len(view):
        raise ProtocolError(f"{len(view) - pos} trailing bytes after the last argument")
    return code, args


def split_args(args: list[bytes], group: int) -> list[tuple[int, int]]:
    """Split a request's arguments into frames the server accepts: at most ``MAX_ARGS``
    arguments and ``MAX_REQUEST_BYTES`` bytes each, never splitting a group of ``group``
    consecutive arguments (a key and its value).  Returns ``[lo, hi)`` ranges in *groups*, so
    a caller indexes its keys with them; a store op of 70000 keys becomes two requests.
    """
    budget = MAX_REQUEST_BYTES - PAYLOAD_HEAD.size - FRAME_LEN.size
    out: list[tuple[int, int]] = []
    lo = count = size = 0
    for g in range(len(args) // group):
        cost = sum(ARG_LEN.size + len(a) for a in args[g * group : (g + 1) * group])
        if g > lo and (count + group > MAX_ARGS or size + cost > budget):
            out.append((lo, g))
            lo, count, size = g, 0, 0
        count, size = count + group, size + cost
    if len(args) // group > lo:
        out.append((lo, len(args) // group))
    return out


class FrameReader:
    """Incremental frame splitter for the non-blocking server (caps checked first)."""

    def __init__(self, max_frame: int = MAX_REQUEST_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_frame

    def feed(self, data: bytes) -> list[bytes]:
        """Append received bytes; return the complete payloads now available."""
        self._buf += data
        frames = []
        while len(self._buf) >= FRAME_LEN.size:
            (n,) = FRAME_LEN.unpack_from(self._buf)
            if n > self._max:
                raise ProtocolError(f"frame of {n} bytes exceeds the cap of {self._max}")
            if len(self._buf) < FRAME_LEN.size + n:
                break
            frames.append(bytes(self._buf[FRAME_LEN.size : FRAME_LEN.size + n]))
            del self._buf[: FRAME_LEN.size + n]
        return frames


class ConnectionLost(Exception):
    """The server closed the connection or reset it (EOF, ECONNRESET, EPIPE)."""


class DeadlinePassed(Exception):
    """A read passed its deadline; ``mid_frame`` means part of a frame was consumed,
    so the connection is out of step and must be dropped."""

    def __init__(self, mid_frame: bool) -> None:
        super().__init__("deadline passed" + (" in the middle of a frame" if mid_frame else ""))
        self.mid_frame = mid_frame


def torch_store_answers(sock: socket.socket, deadline: float) -> bool:
    """Whether the peer answers torch's TCPStore ping (validate, then ping: torch's server echoes
    the 4-byte value); the connection is spent either way.  Only asked of a peer that accepted
    a connection but sent no ringlet greeting ([Note: store protocol])."""
    value = os.getpid() & 0x7FFFFFFF
    try:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        sock.sendall(TORCH_HELLO + b"\x0d" + struct.pack("<I", value))
        return recv_exact(sock, 4, deadline) == struct.pack("<I", value)
    except (OSError, DeadlinePassed, ConnectionLost):
        return False


def under_torchrun() -> bool:
    """Whether torchrun started this process (its agent then serves torch's TCPStore on
    MASTER_PORT), rather than ringlet-run (which says so with ``RINGLET_AGENT_STORE``)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not _env.agent_store()


TORCH_MIXUP = (
    "this process was started by torchrun (TORCHELASTIC_USE_AGENT_STORE=True), whose agent "
    "serves torch's own TCPStore at MASTER_ADDR:MASTER_PORT ({where}); ringlet's store speaks "
    "another protocol. Launch programs that use ringlet.distributed with ringlet-run (it takes "
    "torchrun's flags), or keep torchrun and use torch.distributed"
)


def client_handshake(
    sock: socket.socket, token: bytes | None, join: bool, rank: int, deadline: float, where: str,
    probe_torch: bool = False,
) -> bytes | None:
    """The client's half of the handshake (see the note at the top); returns the token it proved
    (``token``, or the host secret it read when it had none).

    Raises:
        DistStoreError: the server refused our run token, or holds a host secret this
            process cannot read (another host or another user).
        DistNetworkError: the peer is not a ringlet store, or speaks another version, or (with
            ``probe_torch``: launched by torchrun) is torch's TCPStore.
        ConnectionLost, DeadlinePassed: worth a retry (server full or restarting).
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    greet_by = min(deadline, time.monotonic() + GREETING_PROBE_S) if probe_torch else deadline
    try:
        hello = recv_exact(sock, SERVER_HELLO.size, greet_by)
    except DeadlinePassed as e:   # torch's server waits for its client to speak first
        if not e.mid_frame and greet_by < deadline and torch_store_answers(sock, deadline):
            raise DistNetworkError(TORCH_MIXUP.format(where=where), store=where) from None
        raise
    magic, version, server_flags, nonce, sid = SERVER_HELLO.unpack(hello)
    if magic != MAGIC:
        raise DistNetworkError(
            f"the peer at {where} is not a ringlet store (greeting {magic!r})", store=where
        )
    host_secret = token is None and bool(server_flags & SERVER_HOST_SECRET)
    if host_secret:
        token = read_secret(sid.rstrip(b"\0").decode("ascii", "replace"))
    mac = token_mac(token, nonce) if token else bytes(32)
    flags = (CLIENT_HAS_MAC if token else 0) | (CLIENT_JOINS if join else 0)
    sock.settimeout(max(deadline - time.monotonic(), 0.01))
    sock.sendall(CLIENT_HELLO.pack(MAGIC, VERSION, flags, mac, rank))
    (status,) = recv_exact(sock, 1, deadline)
    if status == HS_BAD_TOKEN:
        raise DistStoreError(
            "store refused the connection: bad run token "
            f"({where}){_token_hint(token, host_secret)}",
            store=where,
        )
    if status != HS_OK:
        raise DistNetworkError(
            f"store at {where} speaks protocol version {version}, this client {VERSION}: "
            "expected the same ringlet version on every host",
            store=where,
        )
    return token


def _token_hint(token: bytes | None, host_secret: bool) -> str:
    if host_secret and token is None:
        return (" -- the store was started without a run token, so only processes of its user on "
                "its host (which read its host secret) may join; for ranks on several hosts give "
                "every rank the same token: RINGLET_STORE_TOKEN_FILE, or ringlet-run's "
                "--rdzv-token-file")
    if token is None:
        return " (this client has no token: set RINGLET_STORE_TOKEN_FILE)"
    return ""


FRAME_REST_S = 5.0   # how long the rest of a started response frame may take (read_frame)


def recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """Read exactly ``n`` bytes before ``deadline`` (monotonic; None = no deadline).

    Raises ``DeadlinePassed`` at the deadline and ``ConnectionLost`` on EOF/reset.
    Signals do not shorten the wait: the timeout is recomputed from the deadline.
    """
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlinePassed(mid_frame=got > 0)
            sock.settimeout(remaining)
        else:
            sock.settimeout(None)
        try:
            k = sock.recv_into(view[got:])
        except (TimeoutError, BlockingIOError):
            continue  # re-check the deadline (a signal may have woken us early)
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError) as e:
            raise ConnectionLost(str(e)) from None
        if k == 0:
            raise ConnectionLost("connection closed by the server")
        got += k
    return bytes(buf)


def read_frame(
    sock: socket.socket, deadline: float | None, where: str
) -> tuple[int, list[bytes]]:
    """Read one response frame (client side), checking its length before reading it."""
    (n,) = FRAME_LEN.unpack(recv_exact(sock, FRAME_LEN.size, deadline))
    if n > MAX_RESPONSE_BYTES:
        raise DistStoreError(
            f"store at {where} sent a frame of {n} bytes (cap {MAX_RESPONSE_BYTES}); "
            "is this really a ringlet store?",
            store=where,
        )
    # The server writes a frame in one go: once its length is here, the rest is given
    # FRAME_REST_S past the caller's deadline.  A parked get/wait answered just as its deadline
    # passes, or a client descheduled between the two reads, has its reply in hand: the store is
    # not lost.  A frame still unfinished after that is (a cut link, a stuck server).
    rest = None if deadline is None else max(deadline, time.monotonic() + FRAME_REST_S)
    try:
        return decode_payload(recv_exact(sock, n, rest))
    except DeadlinePassed:
        raise DeadlinePassed(mid_frame=True) from None
    except ProtocolError as e:
        raise DistStoreError(f"malformed reply from store at {where}: {e}", store=where) from None
