"""The ``inproc`` transport: ranks are threads of one process, the arena is process memory.

It runs the very same protocol and algorithms as ``shm`` (see [Note: arena
protocol]), so logic tested with threads in milliseconds is the logic that
runs across processes.  Liveness of a peer is the liveness of its thread.  The buffer heap
([Note: arena buffers]) is anonymous shared memory, reserved up to ``INPROC_BUFFER_BYTES`` per
rank.
"""

from __future__ import annotations

import os
import secrets
import threading
from datetime import timedelta
from typing import Any

from ringlet import _env
from ringlet.transport.arena import H_ABORT, Arena, ArenaLayout, default_p2p_bytes
from ringlet.transport.arena_algos import ArenaTransport
from ringlet.transport.arena_buffers import BufferHeap, anonymous_heap, region_bytes_for

__all__ = ["InprocTransport"]

DEFAULT_SLOT_BYTES = 64 * 1024   # small, so that tests exercise chunking
INPROC_BUFFER_BYTES = 1 << 30    # per rank at most: threads share one address space

_lock = threading.Lock()
_arenas: dict[str, tuple[bytearray, dict[int, threading.Thread], Any]] = {}


class InprocTransport(ArenaTransport):
    """Arena transport among threads of this process (for tests and ``ringlet.testing``)."""

    name = "inproc"

    def __init__(self, arena: Arena, threads: dict[int, threading.Thread]) -> None:
        super().__init__(arena)
        self._threads = threads

    @classmethod
    def create(cls, store, rank: int, world_size: int, timeout: float, group: str,
               slot_bytes: int | None = None) -> InprocTransport:
        slot = slot_bytes or DEFAULT_SLOT_BYTES
        layout = ArenaLayout(world_size, slot, default_p2p_bytes(world_size, slot))
        if rank == 0:
            key = f"{os.getpid()}:{secrets.token_hex(8)}"
            memory = bytearray(layout.total)
            region = region_bytes_for(min(_env.shm_buffer_bytes(), INPROC_BUFFER_BYTES), world_size)
            heap = (anonymous_heap(world_size, region), region) if region else None
            with _lock:
                _arenas[key] = (memory, {}, heap)
            store.set("inproc/key", key)
        else:
            key = store.get("inproc/key").decode()
        with _lock:
            found = _arenas.get(key)
        if found is None:
            owner = key.split(":", 1)[0]
            raise ValueError(
                f"backend 'inproc' (rank {rank}): expected every rank to be a thread of one "
                f"process (rank 0 is process {owner}, this rank is process {os.getpid()}); "
                "'inproc' only serves ranks started with ringlet.testing.run_threads. For "
                "processes on one host use 'shm' (or the default 'auto')")
        memory, threads, heap = found
        with _lock:
            threads[rank] = threading.current_thread()
        arena = Arena(memory, layout, rank, alive=lambda r: threads[r].is_alive(),
                      describe_peer=lambda r: f"thread {threads[r].name}")
        if rank == 0:
            arena.init_header(threading.get_ident())
        store.set(f"inproc/attached/{rank}", b"1")
        store.wait([f"inproc/attached/{r}" for r in range(world_size)], timedelta(seconds=timeout))
        if rank == 0:
            with _lock:
                _arenas.pop(key, None)
        transport = cls(arena, threads)
        if heap is not None:
            q = arena.q
            transport.inplace.use_heap(BufferHeap(heap[0], heap[1], rank, world_size, commit=None,
                                                  healthy=lambda: not q[H_ABORT],
                                                  shared_mapping=True))
        return transport

    def close(self) -> None:
        self.mark_departed()
        self.inplace.close()
