"""Wire format of the ``tcp`` transport: frame headers, the connection handshake, addresses.

[Note: tcp frames]
Every message on a connection is a frame: a fixed 40-byte header, then ``nbytes``
of payload (raw tensor bytes, in the sender's byte order).  The header holds::

    magic u16 | kind u8 | pad u8 | seq i64 | word1 i64 | numel i64 | index u32 | nbytes u64

``kind`` is DATA (collective), P2P, ABORT or BYE.  For DATA, (seq, word1, numel) is
the operation's fingerprint (``OpContext.fingerprint``: op code, dtype, reduce op,
root, element count) and ``index`` counts the frames of this operation between
this pair of ranks in this direction, so the receiver knows the exact header it
must get.  For P2P, ``seq`` is the tag, ``word1`` the message's bytes, ``numel`` the
dtype's code (``base.message_code``).  The
receiver compares the header *before* it reads the payload: a mismatch is a
``CollectiveMismatchError`` naming both calls, never a misread.  An ABORT frame
carries the reason (utf-8) as payload; BYE says that the sender left the group.

[Note: tcp handshake]
Connections are made once, when the group is built: rank ``r`` connects to every
rank below it, once (channel 0; the field is kept so that a future protocol can add
connections without a new handshake).  The
acceptor speaks first (magic, version, its rank, a random nonce); the connector
answers with its claimed rank, the rank it wants, the channel, its own nonce and
``HMAC-SHA256(token, "c" | acceptor nonce | group id | ranks | channel)``; the
acceptor checks the claimed rank against the rendezvous table (a rank that must
connect to it, from the address that rank published), the MAC, and answers a
status byte plus its own MAC over the connector's nonce, so both ends know the
other holds the run token (``ringlet._env.store_token``; the same HMAC as the
TCPStore handshake, ``ringlet.store._protocol.token_mac``) -- or, in a job started
without one, the store's host secret ([Note: host secret] in ``ringlet.store._secret``),
and the group id, which only the store's authenticated clients can read.  Fixed-size
hellos: nothing an unauthenticated peer sends makes anyone allocate.  The acceptor
handshakes every connection at once on non-blocking sockets, each with its own
deadline, so idle or garbage connections never delay a rank (``mesh._Acceptor``).
"""

from __future__ import annotations

import fcntl
import hmac
import socket
import struct
import time

from ringlet.errors import DistNetworkError
from ringlet.store._protocol import DeadlinePassed, recv_exact, token_mac

__all__ = [
    "ABORT",
    "BYE",
    "CONNECT_HELLO",
    "DATA",
    "FRAME_MAGIC",
    "HEADER",
    "HS_OK",
    "P2P",
    "accept_handshake",
    "accept_hello",
    "connect_handshake",
    "header",
    "interface_address",
    "judge_connect_hello",
    "parse_header",
    "refusal",
    "route_source",
]

FRAME_MAGIC = 0x524C          # "RL"
DATA, P2P, ABORT, BYE = 1, 2, 3, 4
KIND_NAMES = {DATA: "collective data", P2P: "point-to-point", ABORT: "abort", BYE: "bye"}
HEADER = struct.Struct("!HBBqqqIQ")
MAX_REASON = 4096             # bytes of an ABORT frame's reason that a receiver reads

HS_MAGIC = b"RNGLTCP1"
HS_VERSION = 1
ACCEPT_HELLO = struct.Struct("!8sHi32s")          # magic, version, acceptor rank, nonce
# magic, version, claimed, target, channel, nonce, mac
CONNECT_HELLO = struct.Struct("!8sHiiB32s32s")
HS_OK, HS_BAD_TOKEN, HS_BAD_RANK, HS_BAD_VERSION = 0, 1, 2, 3
_REFUSALS = {HS_BAD_TOKEN: "a bad run token", HS_BAD_RANK: "a rank it did not expect",
             HS_BAD_VERSION: "another protocol version"}


def header(kind: int, seq: int, word1: int, numel: int, index: int, nbytes: int) -> bytes:
    return HEADER.pack(FRAME_MAGIC, kind, 0, seq, word1, numel, index, nbytes)


def parse_header(raw: bytes | bytearray | memoryview) -> tuple[int, int, int, int, int, int, int]:
    """(magic, kind, seq, word1, numel, index, nbytes) of a raw header."""
    magic, kind, _pad, seq, word1, numel, index, nbytes = HEADER.unpack(raw)
    return magic, kind, seq, word1, numel, index, nbytes


# -- handshake ------------------------------------------------------------------------------
def _mac(token: bytes | None, role: bytes, nonce: bytes, group_id: bytes, a: int, b: int,
         channel: int) -> bytes:
    return token_mac(token or b"", role + nonce + group_id + struct.pack("!iiB", a, b, channel))


def accept_hello(me: int) -> tuple[bytes, bytes]:
    """The acceptor's greeting and the nonce it carries (the acceptor speaks first)."""
    nonce = _nonce()
    return ACCEPT_HELLO.pack(HS_MAGIC, HS_VERSION, me, nonce), nonce


def judge_connect_hello(raw: bytes, me: int, nonce: bytes, token: bytes | None, group_id: bytes,
                        expected: dict[tuple[int, int], str],
                        peer_ip: str) -> tuple[int, int, int, bytes]:
    """Check a connector's fixed-size hello (pure: no I/O).

    Returns (status, claimed rank, channel, the reply to send).  A claim outside ``expected`` --
    the (rank, channel) pairs of the rendezvous table still awaited, each with the address that
    rank published -- is ``HS_BAD_RANK``; a wrong MAC ``HS_BAD_TOKEN``.

    Raises:
        DistNetworkError: the bytes are not a ringlet tcp hello at all.
    """
    magic, version, claimed, target, channel, cnonce, mac = CONNECT_HELLO.unpack(raw)
    if magic != HS_MAGIC:
        raise DistNetworkError(f"connection from {peer_ip} is not a ringlet tcp peer")
    status = HS_OK
    if version != HS_VERSION:
        status = HS_BAD_VERSION
    elif (target != me or (claimed, channel) not in expected
            or expected[(claimed, channel)] != peer_ip):
        status = HS_BAD_RANK
    elif not hmac.compare_digest(mac, _mac(token, b"c", nonce, group_id, claimed, me, channel)):
        status = HS_BAD_TOKEN
    if status != HS_OK:
        return status, claimed, channel, bytes([status]) + bytes(32)
    return status, claimed, channel, bytes([HS_OK]) + _mac(token, b"a", cnonce, group_id, me,
                                                           claimed, channel)


def refusal(status: int, claimed: int, channel: int, peer_ip: str) -> DistNetworkError:
    return DistNetworkError(
        f"refused a connection from {peer_ip} claiming rank {claimed} (channel {channel}): "
        f"{_REFUSALS[status]}", peer=claimed, address=peer_ip)


def accept_handshake(sock: socket.socket, me: int, token: bytes | None, group_id: bytes,
                     expected: dict[tuple[int, int], str], deadline: float) -> tuple[int, int]:
    """Acceptor's half on a blocking socket; returns (peer rank, channel) or raises
    ``DistNetworkError`` (refused).  The mesh itself runs the same steps on non-blocking sockets,
    many at once (``mesh``)."""
    peer_ip = sock.getpeername()[0]
    hello, nonce = accept_hello(me)
    sock.settimeout(max(deadline - time.monotonic(), 0.01))
    sock.sendall(hello)
    raw = recv_exact(sock, CONNECT_HELLO.size, deadline)
    status, claimed, channel, reply = judge_connect_hello(raw, me, nonce, token, group_id, expected,
                                                          peer_ip)
    sock.sendall(reply)
    if status != HS_OK:
        raise refusal(status, claimed, channel, peer_ip)
    return claimed, channel


def connect_handshake(sock: socket.socket, me: int, target: int, channel: int, token: bytes | None,
                      group_id: bytes, deadline: float, where: str) -> None:
    """Connector's half: prove the token, check the acceptor's proof.  Raises
    ``DistNetworkError``."""
    try:
        hello = recv_exact(sock, ACCEPT_HELLO.size, deadline)
        magic, _version, acceptor, nonce = ACCEPT_HELLO.unpack(hello)
        if magic != HS_MAGIC or acceptor != target:
            raise DistNetworkError(f"the peer at {where} is not rank {target} of this group "
                                   f"(greeting {magic!r}, rank {acceptor})", peer=target)
        cnonce = _nonce()
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        sock.sendall(CONNECT_HELLO.pack(HS_MAGIC, HS_VERSION, me, target, channel, cnonce,
                                        _mac(token, b"c", nonce, group_id, me, target, channel)))
        reply = recv_exact(sock, 33, deadline)
    except DeadlinePassed:
        raise DistNetworkError(f"rank {target} at {where} did not complete the handshake in time",
                               peer=target) from None
    status, mac = reply[0], reply[1:]
    if status != HS_OK:
        hint = (" (is RINGLET_STORE_TOKEN[_FILE] the same on every host?)" if status == HS_BAD_TOKEN
                else "")
        raise DistNetworkError(f"rank {target} at {where} refused this rank's connection: "
                               f"{_REFUSALS.get(status, f'status {status}')}{hint}", peer=target)
    if not hmac.compare_digest(mac, _mac(token, b"a", cnonce, group_id, target, me, channel)):
        raise DistNetworkError(f"rank {target} at {where} could not prove "
                               "the run token; refusing it",
                               peer=target)


def _nonce() -> bytes:
    import secrets

    return secrets.token_bytes(32)


# -- addresses -------------------------------------------------------------------------------
_SIOCGIFADDR = 0x8915   # <linux/sockios.h>


def interface_address(name: str) -> str:
    """IPv4 address of interface ``name`` (``RINGLET_IFNAME``).  Raises ``ValueError``."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ValueError("RINGLET_IFNAME: expected an interface with an IPv4 address, "
                             f"got {name!r} ({e.strerror})") from None
    return socket.inet_ntoa(raw[20:24])


def route_source(host: str) -> str | None:
    """The local address the kernel would use to reach ``host`` (nothing is sent), or None."""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
    except OSError:
        return None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)   # prefer IPv4
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect(addr)
        except OSError:
            return None
        return str(s.getsockname()[0])
