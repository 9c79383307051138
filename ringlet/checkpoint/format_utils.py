"""One process, whole checkpoints: export to / import from a single file, verify everything.

* :func:`dcp_to_torch_save` -- a checkpoint as one ``torch.save`` file of the nested state
  dict, loadable with ``torch.load(path, weights_only=True)``;
* :func:`torch_save_to_dcp` -- the reverse (the file is read with ``weights_only=True``);
* :func:`dcp_to_safetensors` / :func:`safetensors_to_dcp` -- a flat ``{dotted key: tensor}``
  safetensors file (plain values travel as JSON in its ``__metadata__``); needs the
  ``safetensors`` package;
* :func:`verify` -- read every byte of every chunk and check its crc32.

Exports hold the whole model in memory (that is what a single file is).  Nested dicts
whose keys are ``0 .. n-1`` come back as lists (the checkpoint keeps only paths), and
tuples as lists.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import torch

from ringlet.checkpoint._coord import Coordinator
from ringlet.checkpoint._flatten import tree_from_paths
from ringlet.checkpoint._load import load_into
from ringlet.checkpoint._metadata import BLOCK_BYTES, METADATA_FILE, Metadata
from ringlet.checkpoint._save import finish, prepare, write
from ringlet.checkpoint._storage import open_shard, pread_into, read_metadata
from ringlet.checkpoint.filesystem import FileSystemWriter

__all__ = ["dcp_to_safetensors", "dcp_to_torch_save", "read_all", "safetensors_to_dcp",
           "torch_save_to_dcp", "verify"]


def _metadata(directory: str) -> Metadata:
    return Metadata.from_json_bytes(read_metadata(directory),
                                    os.path.join(directory, METADATA_FILE))


def read_all(directory: str) -> dict[str, Any]:
    """The whole checkpoint as a nested state dict of full tensors and values
    (checksums verified)."""
    meta = _metadata(directory)
    tree = tree_from_paths([(t.path, torch.empty(t.shape, dtype=t.torch_dtype))
                            for t in meta.tensors.values()]
                           + [(p, None) for p, _ in meta.values.values()])
    load_into(tree, directory, Coordinator())
    return tree


def _save_local(state_dict: dict[str, Any], directory: str) -> None:
    writer, coord = FileSystemWriter(directory), Coordinator()
    prep = prepare(state_dict, writer, coord)
    finish(prep, write(prep, 0), coord)


def dcp_to_torch_save(dcp_checkpoint_dir: str | os.PathLike[str],
                      torch_save_path: str | os.PathLike[str]) -> None:
    """Write the checkpoint in ``dcp_checkpoint_dir`` as one ``torch.save`` file."""
    torch.save(read_all(os.fspath(dcp_checkpoint_dir)), os.fspath(torch_save_path))


def torch_save_to_dcp(torch_save_path: str | os.PathLike[str],
                      dcp_checkpoint_dir: str | os.PathLike[str]) -> None:
    """Turn a ``torch.save`` file of a state dict into a checkpoint (read with
    ``weights_only=True``)."""
    sd = torch.load(os.fspath(torch_save_path), map_location="cpu", weights_only=True)
    if not isinstance(sd, dict):
        raise TypeError(f"{torch_save_path}: expected a state dict (a "
                        f"dict), got {type(sd).__name__}")
    _save_local(sd, os.fspath(dcp_checkpoint_dir))


def dcp_to_safetensors(dcp_checkpoint_dir: str | os.PathLike[str],
                       path: str | os.PathLike[str]) -> None:
    """Write the checkpoint as one safetensors file keyed by dotted key."""
    from safetensors.torch import save_file

    directory = os.fspath(dcp_checkpoint_dir)
    meta = _metadata(directory)
    flat = {k: torch.empty(t.shape, dtype=t.torch_dtype) for k, t in meta.tensors.items()}
    _load_flat(flat, directory)
    extra = {"ringlet.values": json.dumps({k: v for k, (_, v) in meta.values.items()})}
    save_file(flat, os.fspath(path), metadata=extra)


def _load_flat(flat: dict[str, torch.Tensor], directory: str) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # the values are exported separately
        load_into(flat, directory, Coordinator())


def safetensors_to_dcp(path: str | os.PathLike[str],
                       dcp_checkpoint_dir: str | os.PathLike[str]) -> None:
    """Turn a flat safetensors file into a checkpoint (keys as written; values
    from ``__metadata__``)."""
    from safetensors import safe_open

    from ringlet.checkpoint._flatten import decode_value

    sd: dict[str, Any] = {}
    with safe_open(os.fspath(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
            sd[key] = f.get_tensor(key)
        extra = (f.metadata() or {}).get("ringlet.values")
    if extra:
        sd.update({k: decode_value(v, k) for k, v in json.loads(extra).items()})
    _save_local(sd, os.fspath(dcp_checkpoint_dir))


def verify(directory: str | os.PathLike[str]) -> list[str]:
    """Every problem found reading every chunk of the checkpoint (empty: all checksums match)."""
    directory = os.fspath(directory)
    meta = _metadata(directory)
    problems: list[str] = []
    buf = memoryview(bytearray(BLOCK_BYTES))
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name, size in meta.files.items():
            try:
                fd = open_shard(dir_fd, name, size)
            except ValueError as e:
                problems.append(str(e))
                continue
            try:
                for t in meta.tensors.values():
                    for c in (c for c in t.chunks if c.file == name):
                        problems += _verify_chunk(fd, buf, t.key, c)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)
    return problems


def _verify_chunk(fd: int, buf: memoryview, key: str, c: Any) -> list[str]:
    out = []
    for b, want in enumerate(c.crc32):
        lo = c.begin + b * BLOCK_BYTES
        n = min(BLOCK_BYTES, c.end - lo)
        try:
            pread_into(fd, buf[:n], lo, c.file)
        except ValueError as e:
            return [f"{c.file}: tensor {key!r} chunk {c.box}: {e}"]
        got = zlib.crc32(buf[:n])
        if got != want:
            out.append(f"{c.file}: tensor {key!r} chunk {c.box}: crc32 of bytes [{lo}, {lo + n}) "
                       f"is {got:08x}, expected {want:08x}")
    return out
