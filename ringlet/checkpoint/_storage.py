"""Files of a checkpoint directory: safe opening, shard files, the commit, the lock.

A directory holds ``metadata.json`` (the commit record) and one shard file per writing
rank and save, ``shard-<save id>-<rank>.safetensors``.  A save writes its shards under a
fresh save id, fsyncs them and the directory, writes the metadata to a temporary name,
fsyncs it and renames it over ``metadata.json`` (atomic), fsyncs the directory again and
only then deletes the shards of earlier saves.  So a reader finds the previous
checkpoint or the new one, never a mix, and a save that dies leaves the previous one
loadable (its stray shards are deleted by the next successful save).

Shard files are safetensors files: an 8-byte little-endian header length, a JSON
header naming every chunk (``<key>@<offsets>``) with its dtype, shape and byte range,
then the chunks back to back.  Reading opens names from metadata relative to the
directory with ``O_NOFOLLOW`` (a symlink is refused) and ``O_NONBLOCK`` (a FIFO cannot
block), and refuses anything that is not a regular file of the recorded size.
"""

from __future__ import annotations

import concurrent.futures
import errno
import fcntl
import json
import os
import re
import signal
import stat
import struct
import sys
import zlib
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ringlet import _env
from ringlet.checkpoint._geometry import Box
from ringlet.checkpoint._metadata import (
    BLOCK_BYTES,
    DTYPES,
    FORMAT,
    MAX_METADATA_BYTES,
    METADATA_FILE,
    ChunkMeta,
)

__all__ = ["DirLock", "commit", "open_shard", "pread_into", "read_metadata", "remove_quietly",
           "shard_name", "tensor_bytes", "write_shard"]

_SHARD = re.compile(r"shard-([0-9a-f]{16})-\d{5}\.safetensors")
_TMP_META = re.compile(r"\.metadata\.json\.([0-9a-f]{16})\.tmp")
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def shard_name(save_id: str, rank: int) -> str:
    return f"shard-{save_id}-{rank:05d}.safetensors"


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, 0-d included)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise AssertionError("tensor_bytes: expected a contiguous CPU tensor")
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data.cast("B")


def _write_all(fd: int, data: memoryview, path: str) -> None:
    done = 0
    while done < len(data):
        n = os.write(fd, data[done:])
        if n <= 0:
            raise OSError(errno.EIO, f"write returned {n}", path)
        done += n


class _Fault:
    """``RINGLET_CKPT_FAULT=rank=R;after_bytes=N;do=sigkill``: rank R dies N
    bytes into its shard."""

    def __init__(self, rank: int) -> None:
        self.limit: int | None = None
        spec = _env.ckpt_fault_spec()
        if spec:
            fields = dict(part.split("=", 1) for part in spec.split(";") if "=" in part)
            if int(fields.get("rank", -1)) == rank and fields.get("do") == "sigkill":
                self.limit = int(fields["after_bytes"])

    def write(self, fd: int, data: memoryview, written: int, path: str) -> None:
        if self.limit is not None and written + len(data) > self.limit:
            _write_all(fd, data[:max(0, self.limit - written)], path)
            os.fsync(fd)
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        _write_all(fd, data, path)


def _header(save_id: str, rank: int, items: list[tuple[str, Box, str]]) -> tuple[bytes, list[int]]:
    """The safetensors header for chunks ``items`` (key, box, dtype name)
    and their begin offsets."""
    head: dict[str, Any] = {"__metadata__": {"format": FORMAT, "save_id": save_id,
                                             "rank": str(rank)}}
    offset, begins = 0, []
    for key, box, dtype in items:
        torch_dtype, st_name = DTYPES[dtype]
        n = box.numel * torch_dtype.itemsize
        head[f"{key}@{','.join(map(str, box.offsets))}"] = {
            "dtype": st_name or dtype, "shape": list(box.sizes),
            "data_offsets": [offset, offset + n]}
        begins.append(offset)
        offset += n
    raw = json.dumps(head, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(len(raw) + 8) % 64)        # data starts 64-byte aligned
    return struct.pack("<Q", len(raw)) + raw, begins


def _crcs(data: memoryview) -> tuple[int, ...]:
    return tuple(zlib.crc32(data[j:j + BLOCK_BYTES]) for j in range(0, len(data), BLOCK_BYTES))


def write_shard(directory: str, name: str, save_id: str, rank: int,
                items: list[tuple[str, Box, str, Callable[[], torch.Tensor]]],
                sync: bool) -> tuple[int, list[ChunkMeta]]:
    """Write one rank's shard file; ``items`` give each chunk's key, box, dtype name and a
    function that returns its contiguous CPU tensor.

    The checksums of a chunk are computed on a helper thread while the next chunk is written
    and while the file is fsynced (zlib and the write/fsync calls release the GIL; ``write``
    often sleeps in the kernel's dirty-page throttling).  At most one chunk waits for its
    checksum, so at most two staging copies (for non-contiguous pieces) are alive.

    Returns the file's size and the chunks' records (byte ranges and block checksums).
    Raises ``OSError`` (disk full, permissions) naming the path; the partial file is removed.
    """
    path = os.path.join(directory, name)
    header, begins = _header(save_id, rank, [(k, b, d) for k, b, d, _ in items])
    fault = _Fault(rank)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    pending: list[concurrent.futures.Future[tuple[int, ...]]] = []
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ringlet-ckpt-crc")
    try:
        fault.write(fd, memoryview(header), 0, path)
        for (_, _, _, get), begin in zip(items, begins, strict=True):
            data = tensor_bytes(get())
            if pending:
                pending[-1].result()          # bound the copies alive: one chunk in flight
            pending.append(pool.submit(_crcs, data))
            fault.write(fd, data, len(header) + begin, path)
            del data
        size = os.lseek(fd, 0, os.SEEK_CUR)
        if sync:
            os.fsync(fd)
        crcs = [f.result() for f in pending]
    except BaseException:
        os.close(fd)
        remove_quietly(directory, name)
        raise
    finally:
        pool.shutdown(wait=True)
    os.close(fd)
    chunks = [ChunkMeta(box, name, len(header) + begin,
                        len(header) + begin + box.numel * DTYPES[d][0].itemsize, c)
              for (_, box, d, _), begin, c in zip(items, begins, crcs, strict=True)]
    return size, chunks


def remove_quietly(directory: str, name: str) -> None:
    try:
        os.unlink(os.path.join(directory, name))
    except OSError:
        pass


def open_shard(dir_fd: int, name: str, size: int) -> int:
    """Open a data file named by metadata for reading: no symlink, a regular file of ``size`` bytes.

    Raises ``ValueError`` naming the file and what is wrong with it.
    """
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ValueError(f"{name}: missing") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{name}: is a symlink; checkpoint files are "
                             "never followed through links") from None
        raise ValueError(f"{name}: cannot open ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise ValueError(f"{name}: not a regular file")
    if st.st_size != size:
        os.close(fd)
        raise ValueError(f"{name}: expected {size} bytes, found "
                         f"{st.st_size} (truncated or replaced)")
    return fd


def pread_into(fd: int, buf: memoryview, offset: int, name: str) -> None:
    """Fill ``buf`` from ``offset`` of the file (short reads retried; end of file is an error)."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise ValueError(f"{name}: ended at byte {offset + done}, expected at "
                             f"least {offset + len(buf)}")
        done += n


def read_metadata(directory: str) -> bytes:
    """The raw bytes of ``metadata.json`` (no symlink, bounded size);
    ``FileNotFoundError`` if absent."""
    try:
        fd = os.open(os.path.join(directory, METADATA_FILE), _READ_FLAGS)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(f"{directory}/{METADATA_FILE}: is a symlink (refused)") from None
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            raise FileNotFoundError(f"{directory}: no committed checkpoint "
                                    f"({METADATA_FILE} not found)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_METADATA_BYTES:
            raise ValueError(f"{directory}/{METADATA_FILE}: expected a regular file of at most "
                             f"{MAX_METADATA_BYTES} bytes")
        buf = bytearray(st.st_size)
        pread_into(fd, memoryview(buf), 0, METADATA_FILE)
        return bytes(buf)
    finally:
        os.close(fd)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(directory: str, metadata: bytes, save_id: str, keep: Iterable[str], sync: bool) -> None:
    """Publish ``metadata`` atomically, then delete shards and temporaries of other saves."""
    if sync:
        _fsync_dir(directory)            # the shards' directory entries are durable first
    tmp = f".metadata.json.{save_id}.tmp"
    fd = os.open(os.path.join(directory, tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW
                 | os.O_CLOEXEC, 0o644)
    try:
        _write_all(fd, memoryview(metadata), tmp)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(os.path.join(directory, tmp), os.path.join(directory, METADATA_FILE))
    if sync:
        _fsync_dir(directory)
    keep = set(keep)
    for entry in os.listdir(directory):
        if entry not in keep and (_SHARD.fullmatch(entry) or _TMP_META.fullmatch(entry)):
            remove_quietly(directory, entry)


class DirLock:
    """An exclusive ``flock`` on ``<dir>/.lock``: two jobs never save into one directory at once."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, ".lock")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ValueError(f"{directory}: another save into this directory is in progress "
                                 f"(lock {self.path} is held)") from None
            raise

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
