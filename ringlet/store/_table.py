"""The TCPStore server's state and op semantics, free of sockets (unit-testable).

``KeyTable.handle`` answers a request at once or returns a ``Parked`` request; writes wake
parked requests, collected by ``pop_ready``. Wire format: [Note: store protocol] in
``_protocol``; queues: [Note: store queues] in ``base``.
"""

from __future__ import annotations

from collections import deque

from ringlet.store._protocol import (
    MAX_KEY_BYTES,
    MAX_KEYS,
    MAX_VALUE_BYTES,
    Op,
    ProtocolError,
    Status,
)
from ringlet.store.base import parse_counter, pop_queue, present

__all__ = ["KeyTable", "Parked", "Reply"]


Reply = tuple[Status, list[bytes]]


class Parked:
    """A ``MULTI_GET``/``WAIT``/``QUEUE_POP`` request waiting for its keys (one per connection)."""

    __slots__ = ("done", "keys", "kind", "owner", "registered")

    def __init__(self, owner: object, keys: list[str], kind: int) -> None:
        self.owner = owner  # the server's connection object; opaque here
        self.keys = keys
        self.kind = kind  # the Op: what "present" means and what the reply holds
        self.registered: set[str] = set()  # keys whose waiter lists hold this request
        self.done = False


class KeyTable:
    """The store server's state and op semantics, free of sockets (unit-testable).

    ``handle`` answers a request at once or returns a ``Parked``; writes wake parked
    requests, collected by ``pop_ready`` as (owner, reply) pairs. Blocking is thus
    event-driven: nothing polls.
    """

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.queues: dict[str, deque[bytes]] = {}  # [Note: store queues] in base
        self._queued = 0  # values in all queues (capped with the keys)
        self._waiters: dict[str, list[Parked]] = {}
        self._woken: list[Parked] = []

    def handle(self, owner: object, op: int, args: list[bytes]) -> Reply | Parked:
        """Apply one request. Raises ``ProtocolError`` for a malformed one."""
        if op in (Op.MULTI_GET, Op.WAIT) or (op == Op.QUEUE_POP and args[1:] == [b"1"]):
            if not args:
                raise ProtocolError(f"{Op(op).name} without keys")
            keys = [self._key(args[0])] if op == Op.QUEUE_POP else [self._key(a) for a in args]
            parked = Parked(owner, keys, op)
            return self._serve_or_park(parked) or parked
        try:
            return self._apply(op, args)
        except ValueError as e:  # add() on a non-integer value
            return Status.VALUE_ERROR, [str(e).encode()]
        except _Refused as e:
            return Status.ERROR, [str(e).encode()]

    def _apply(self, op: int, args: list[bytes]) -> Reply:
        data = self.data
        if op == Op.SET:
            key, value = self._args(op, args, 2)
            self._store(self._key(key), self._value(value))
        elif op == Op.MULTI_SET:
            if len(args) % 2:
                raise ProtocolError("MULTI_SET with an odd number of arguments")
            pairs = [(self._key(k), self._value(v)) for k, v in zip(args[::2], args[1::2])]
            for key_s, value in pairs:
                self._store(key_s, value)
        elif op == Op.ADD:
            key, amount = self._args(op, args, 2)
            key_s, new = self._key(key), _parse_int(amount)
            if key_s in data:
                new += parse_counter(key_s, data[key_s])
            self._store(key_s, str(new).encode("ascii"))
            return Status.OK, [str(new).encode("ascii")]
        elif op == Op.COMPARE_SET:
            key, expected, desired = self._args(op, args, 3)
            key_s = self._key(key)
            current = data.get(key_s)
            if (current is None and expected == b"") or current == expected:
                self._store(key_s, self._value(desired))
                return Status.OK, [desired]
            return Status.OK, [expected if current is None else current]
        elif op == Op.APPEND:
            key, value = self._args(op, args, 2)
            key_s = self._key(key)
            self._store(key_s, self._value(data.get(key_s, b"") + value))
        elif op == Op.CHECK:
            found = all(present(data, self.queues, self._key(k)) for k in args)
            return Status.OK, [b"1" if found else b"0"]
        elif op in (Op.QUEUE_PUSH, Op.QUEUE_POP, Op.QUEUE_LEN, Op.LIST_KEYS):
            return self._apply_queue(op, args)
        elif op == Op.DELETE:
            (key,) = self._args(op, args, 1)
            return Status.OK, [b"1" if data.pop(self._key(key), None) is not None else b"0"]
        elif op == Op.NUM_KEYS:
            return Status.OK, [str(len(data)).encode("ascii")]
        elif op != Op.PING:
            raise ProtocolError(f"unknown op code {op}")
        return Status.OK, []

    def _apply_queue(self, op: int, args: list[bytes]) -> Reply:
        if op == Op.LIST_KEYS:
            self._args(op, args, 0)
            return Status.OK, [k.encode("utf-8") for k in self.data]
        if op == Op.QUEUE_PUSH:
            key, value = self._args(op, args, 2)
            key_s = self._key(key)
            if self._queued + len(self.data) >= MAX_KEYS:
                raise _Refused(f"store is full ({MAX_KEYS} keys and queued values)")
            self.queues.setdefault(key_s, deque()).append(self._value(value))
            self._queued += 1
            self._wake(key_s)
            return Status.OK, []
        if op == Op.QUEUE_LEN:
            (key,) = self._args(op, args, 1)
            return Status.OK, [str(len(self.queues.get(self._key(key), ()))).encode("ascii")]
        key, _block = self._args(op, args, 2)   # a non-blocking QUEUE_POP (blocking ones park)
        popped = self._pop(self._key(key))
        if popped is None:
            return (Status.QUEUE_EMPTY,
                    [f"queue {key.decode('utf-8', 'replace')!r} is empty".encode()])
        return Status.OK, [popped]

    def _pop(self, key: str) -> bytes | None:
        value = pop_queue(self.queues, key)
        if value is not None:
            self._queued -= 1
        return value

    @staticmethod
    def _args(op: int, args: list[bytes], n: int) -> list[bytes]:
        if len(args) != n:
            raise ProtocolError(f"{Op(op).name} expects {n} arguments, got {len(args)}")
        return args

    @staticmethod
    def _key(raw: bytes) -> str:
        if len(raw) > MAX_KEY_BYTES:
            raise ProtocolError(f"key of {len(raw)} bytes exceeds the cap of {MAX_KEY_BYTES}")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("key is not valid UTF-8") from None

    @staticmethod
    def _value(raw: bytes) -> bytes:
        if len(raw) > MAX_VALUE_BYTES:
            raise _Refused(f"value of {len(raw)} bytes exceeds the cap of {MAX_VALUE_BYTES}")
        return raw

    def _store(self, key: str, value: bytes) -> None:
        if key not in self.data and len(self.data) >= MAX_KEYS:
            raise _Refused(f"store is full ({MAX_KEYS} keys)")
        self.data[key] = value
        self._wake(key)

    def _wake(self, key: str) -> None:
        for parked in self._waiters.pop(key, ()):
            parked.registered.discard(key)
            if not parked.done:
                self._woken.append(parked)

    def _serve_or_park(self, parked: Parked) -> Reply | None:
        if parked.kind == Op.MULTI_GET:
            missing = [k for k in parked.keys if k not in self.data]
        else:   # WAIT and QUEUE_POP: a non-empty queue counts ([Note: store queues])
            missing = [k for k in parked.keys if not present(self.data, self.queues, k)]
        if missing:
            for key in missing:
                if key not in parked.registered:
                    parked.registered.add(key)
                    self._waiters.setdefault(key, []).append(parked)
            return None
        parked.done = True
        if parked.kind == Op.QUEUE_POP:
            return Status.OK, [self._pop(parked.keys[0]) or b""]
        values = [self.data[k] for k in parked.keys] if parked.kind == Op.MULTI_GET else []
        return Status.OK, values

    def pop_ready(self) -> list[tuple[object, Reply]]:
        """Replies to parked requests that the writes since the last call completed."""
        woken, self._woken = self._woken, []
        ready = []
        for parked in woken:
            if not parked.done:
                reply = self._serve_or_park(parked)  # None: a key was deleted meanwhile
                if reply is not None:
                    ready.append((parked.owner, reply))
        return ready

    def cancel(self, parked: Parked) -> None:
        """Forget a parked request (client gave up, or its connection closed)."""
        parked.done = True
        for key in parked.registered:
            waiters = self._waiters.get(key, [])
            if parked in waiters:
                waiters.remove(parked)
            if not waiters:
                self._waiters.pop(key, None)
        parked.registered.clear()


class _Refused(Exception):
    """A well-formed request the server declines (cap reached); the client gets ERROR."""


def _parse_int(raw: bytes) -> int:
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ProtocolError(f"ADD amount {raw[:32]!r} is not an ASCII integer") from None

