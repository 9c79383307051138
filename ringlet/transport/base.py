"""The transport interface: move bytes of contiguous tensors between the ranks of one group.

A transport knows its ranks and nothing of groups' semantics: argument checks,
sequence numbers, ordering, debug fingerprints and error policy live once, in
the process-group layer (``ringlet.c10d``), which hands every call an
:class:`OpContext`.  All tensors given to a transport are contiguous tensors of
the devices it serves; outputs are written in place.  Reductions are resolved
by ``ringlet.transport.reduce`` ([Note: reductions]); pieces of large tensors
are cut by :func:`chunks`.

[Note: rank subsets]
A collective may run over part of the group (``ranks=``: the group ranks taking
part, in order; only they call).  Roots and block order then index into
``ranks``, and a reduction folds in that order.  This is how one transport is
composed from two (``hierarchical``: a reduction among the hosts runs over one
rank per host).  Transports that cannot do it (``subsets = False``) raise
``NotImplementedError`` for a proper subset.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from ringlet.errors import DistError
from ringlet.transport.reduce import RedOpType, Reduction

_E = TypeVar("_E", bound=DistError)

__all__ = ["CODE_DTYPES", "DTYPE_CODES", "OPCODES", "OpContext", "Ranks", "ReduceArg", "Transport",
           "chunks", "split_blocks", "whole_group"]

ReduceArg = RedOpType | Reduction    # a reduce op (with a factor for PREMUL_SUM), or a resolved one
Ranks = Sequence[int] | None         # a subset of the group's ranks ([Note: rank subsets])

# Operation codes carried in fingerprints (stable: they cross process boundaries).
OPCODES: dict[str, int] = {
    name: i
    for i, name in enumerate(
        [
            "barrier", "all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter",
            "reduce_scatter", "all_to_all", "send", "recv", "monitored_barrier", "agree",
            "debug_check",
        ],
        start=1,
    )
}
OPNAMES = {v: k for k, v in OPCODES.items()}

_DTYPES = [
    torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
    torch.complex128, torch.uint16, torch.uint32, torch.uint64,
]
DTYPE_CODES: dict[torch.dtype, int] = {d: i + 1 for i, d in enumerate(_DTYPES)}
CODE_DTYPES: dict[int, torch.dtype] = {v: k for k, v in DTYPE_CODES.items()}


class OpContext:
    """Everything a transport needs to run, check and explain one operation.

    A plain ``__slots__`` class (not a dataclass): one is built per collective,
    on the latency path.
    """

    __slots__ = (
        "callsite",
        "deadline",
        "dtype",
        "group",
        "numel",
        "op",
        "rank",
        "redop",
        "root",
        "seq",
        "shape",
        "started",
        "timeout",
        "world_size",
    )

    def __init__(self, op: str, seq: int, rank: int, world_size: int, group: str, timeout: float,
                 dtype: torch.dtype | None = None, numel: int = 0, root: int = -1, redop: int = -1,
                 shape: tuple[int, ...] | None = None, callsite: str | None = None) -> None:
        self.op = op                    # public name, e.g. "all_reduce"
        self.seq = seq                  # per-group sequence number of this collective
        self.rank = rank                # this rank's rank in the group
        self.world_size = world_size
        self.group = group              # readable group name for messages
        self.timeout = timeout          # seconds
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.dtype = dtype
        self.numel = numel              # elements of this rank's (input) tensor
        self.root = root                # group rank of the root / peer, -1 if none
        self.redop = redop              # RedOpType value, -1 if none
        self.shape = shape              # full shape (debug DETAIL)
        self.callsite = callsite        # user's file:line (debug DETAIL)

    @classmethod
    def make(cls, op: str, seq: int, rank: int, world_size: int, group: str, timeout: float,
             **fields: Any) -> OpContext:
        return cls(op, seq, rank, world_size, group, timeout, **fields)

    # Fingerprint: 3 int64 words exchanged with the data (see ringlet/transport/arena.py).
    def fingerprint(self) -> tuple[int, int, int]:
        dcode = DTYPE_CODES.get(self.dtype, 0) if self.dtype is not None else 0
        word1 = OPCODES[self.op] | (dcode << 8) | ((self.redop + 1) << 16) | ((self.root + 1) << 24)
        return (self.seq, word1, self.numel)

    def describe(self) -> str:
        """One line: ``all_reduce #5 float32[4] SUM``."""
        parts = [f"{self.op} #{self.seq}"]
        if self.dtype is not None:
            shape = "x".join(map(str, self.shape)) if self.shape is not None else str(self.numel)
            parts.append(f"{str(self.dtype).replace('torch.', '')}[{shape}]")
        if self.redop >= 0:
            parts.append(RedOpType(self.redop).name)
        if self.root >= 0:
            parts.append(f"root/peer {self.root}")
        if self.callsite:
            parts.append(f"at {self.callsite}")
        return " ".join(parts)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def error(self, cls: type[_E], what: str, **extra: Any) -> _E:
        """Build an error carrying the fields every error message promises (who, what, when: see
        docs/reliability.md#error-messages)."""
        msg = (f"[rank {self.rank}/{self.world_size}] group {self.group}: {self.describe()}: "
               f"{what} (elapsed {self.elapsed():.2f} s, timeout {self.timeout:.1f} s)")
        return cls(msg, rank=self.rank, world_size=self.world_size, group=self.group, op=self.op,
                   seq=self.seq, timeout=self.timeout, elapsed=self.elapsed(), **extra)


def describe_fingerprint(fp: tuple[int, int, int]) -> str:
    """Readable form of a peer's fingerprint (for mismatch reports)."""
    seq, word1, numel = fp
    op = OPNAMES.get(word1 & 0xFF, f"op{word1 & 0xFF}")
    dtype = CODE_DTYPES.get((word1 >> 8) & 0xFF)
    redop = ((word1 >> 16) & 0xFF) - 1
    root = ((word1 >> 24) & 0xFFFF) - 1
    parts = [f"{op} #{seq}"]
    if dtype is not None:
        parts.append(f"{str(dtype).replace('torch.', '')}[{numel}]")
    if redop >= 0:
        parts.append(RedOpType(redop).name)
    if root >= 0:
        parts.append(f"root/peer {root}")
    return " ".join(parts)


def message_code(ctx: OpContext) -> int:
    """The dtype code a point-to-point message carries in its header (0: unknown), so that a
    receive into another dtype of the same byte size is refused instead of misread."""
    return DTYPE_CODES.get(ctx.dtype, 0) if ctx.dtype is not None else 0


def message_mismatch(src: int, got: tuple[int, int, int], ctx: OpContext,
                     want: tuple[int, int]) -> str:
    """Why a received message's header (``got``: tag, bytes, dtype code) does not fit this
    receive (``want``: tag, bytes; dtype and shape from ``ctx``), naming both ranks' sides."""
    gtag, gbytes, gcode = got
    gdtype = CODE_DTYPES.get(gcode)
    if gdtype is not None:
        size = gdtype.itemsize
        sent = (f"{str(gdtype).removeprefix('torch.')} data of "
                f"{f'{gbytes // size} elements' if gbytes % size == 0 else 'a partial element'} "
                f"({gbytes} bytes)")
    else:
        sent = f"a message of {gbytes} bytes"
    dtype = str(ctx.dtype).removeprefix("torch.") if ctx.dtype is not None else "?"
    shape = list(ctx.shape) if ctx.shape is not None else f"[{ctx.numel}]"
    return (f"rank {src} sent {sent} with tag {gtag}, but rank {ctx.rank} expected {dtype} of "
            f"shape {shape} ({want[1]} bytes) with tag {want[0]}; send and recv must use the "
            "same dtype and number of elements")


def split_blocks(numel: int, n: int) -> list[tuple[int, int]]:
    """(offset, count) of ``n`` nearly equal blocks covering ``numel`` elements, the first
    ``numel % n`` one element longer (one block per rank of a reduce-scatter).

    Example::

        >>> split_blocks(10, 3)
        [(0, 4), (4, 3), (7, 3)]
    """
    q, rem = divmod(numel, n)
    out, off = [], 0
    for i in range(n):
        c = q + (1 if i < rem else 0)
        out.append((off, c))
        off += c
    return out


def chunks(total: int, cap: int) -> list[tuple[int, int]]:
    """(offset, count) pieces of at most ``cap`` items covering ``total``, in order; one empty
    piece when ``total`` is 0, so that an empty message is still one round or one frame and the
    ranks stay in step.  The one chunker of every transport.

    Example::

        >>> chunks(10, 4), chunks(0, 4)
        ([(0, 4), (4, 4), (8, 2)], [(0, 0)])
    """
    if total <= cap:
        return [(0, total)]
    cap = max(cap, 1)
    return [(o, min(cap, total - o)) for o in range(0, total, cap)]


class Transport(abc.ABC):
    """Moves and reduces the bytes of contiguous tensors among ``world_size`` ranks.

    Reducing calls take ``op`` (a :class:`RedOpType`, with ``factor`` for PREMUL_SUM, or an
    already resolved :class:`Reduction`, ``factor`` None); collectives take ``ranks``
    ([Note: rank subsets]).
    """

    name: str = "?"
    rank: int
    world_size: int
    devices: tuple[str, ...] = ("cpu",)   # device types whose tensors this transport serves
    subsets: bool = False                 # runs collectives over a subset of its ranks
    # Device types whose calls only queue work on the caller's current stream and return without
    # waiting for it (torch's NCCL): see [Note: CUDA streams] in ringlet/c10d/_cuda.py.
    stream_ordered: tuple[str, ...] = ()

    @abc.abstractmethod
    def all_reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        """Reduce ``buf`` across ranks, result in ``buf`` on every rank."""

    @abc.abstractmethod
    def reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, root: int,
               ctx: OpContext, ranks: Ranks = None) -> None:
        """Reduce ``buf`` across ranks into ``buf`` on ``root``; others' ``buf`` unchanged."""

    @abc.abstractmethod
    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext, ranks: Ranks = None) -> None:
        """Copy root's ``buf`` into everyone's ``buf``."""

    @abc.abstractmethod
    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        """``out`` (world_size * inp.numel elements) receives every rank's ``inp`` in rank order."""

    @abc.abstractmethod
    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: Ranks = None) -> None:
        """Like all_gather but only ``root`` receives (``out`` is None elsewhere)."""

    @abc.abstractmethod
    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: Ranks = None) -> None:
        """Root's ``inp`` (world_size * out.numel elements) is split in rank order."""

    @abc.abstractmethod
    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReduceArg,
                       factor: float | None, ctx: OpContext, ranks: Ranks = None) -> None:
        """Block ``r`` of every rank's ``inp`` is reduced into rank ``r``'s ``out``."""

    @abc.abstractmethod
    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext, ranks: Ranks = None) -> None:
        """Byte-level all-to-all: ``inp`` (uint8) holds ``in_splits[j]`` bytes for rank j, in
        order."""

    @abc.abstractmethod
    def barrier(self, ctx: OpContext, ranks: Ranks = None) -> None:
        """Return once every rank has entered the barrier."""

    @abc.abstractmethod
    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        """Deliver ``buf``'s bytes to ``dst``; returns once they are handed over."""

    @abc.abstractmethod
    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        """Receive into ``buf`` from ``src`` (None: any rank); returns the source rank."""

    # -- receiving from any rank of two transports at once (``hierarchical``) ------------------
    def pending_source(self) -> int | None:
        """The lowest rank whose next message has arrived (or is arriving); never waits."""
        raise NotImplementedError(f"{type(self).__name__} cannot look for pending messages")

    def watch_any_source(self, delta: int) -> None:
        """A receive from any rank that polls :meth:`pending_source` starts (+1) or ends (-1)."""

    def check_any_source(self, ctx: OpContext) -> None:
        """Raise if a receive from any rank cannot succeed here (aborted, destroyed, nobody
        left)."""

    # -- memory that peers read in place ([Note: arena buffers]) ---------------------------------
    def buffer(self, nbytes: int) -> torch.Tensor | None:
        """``nbytes`` of memory (a ``uint8`` tensor) that this transport's collectives read and
        write in place, with no copy through its own buffers; None when it has no such memory
        (callers then use ordinary tensors, which every transport serves)."""
        return None

    # -- hints, statistics, lifecycle -----------------------------------------------------------
    def share_cpus(self, busy_ranks: int) -> None:
        """``busy_ranks`` of the job's ranks share this process's CPUs (its own transport's and
        others', e.g. simulated hosts on one machine): a transport that spins may stop spinning."""

    def wait_stats(self) -> tuple[float, dict[int, float]]:
        """Seconds spent waiting for peers, in total and per rank that arrived last."""
        return 0.0, {}

    def abort(self, reason: str) -> None:
        """Poison the transport so that every rank's pending and later calls fail fast."""

    def close(self) -> None:
        """Release resources; bounded, never blocks on peers."""


def whole_group(tr: Transport, ranks: Ranks) -> None:
    """Raise ``NotImplementedError`` unless ``ranks`` is None or every rank of ``tr`` in order
    (for transports without subsets)."""
    if ranks is not None and list(ranks) != list(range(tr.world_size)):
        raise NotImplementedError(f"{type(tr).__name__} runs collectives over all its ranks, "
                                  f"got the subset {list(ranks)}")
