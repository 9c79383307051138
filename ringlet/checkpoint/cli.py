"""``python -m ringlet.distributed.checkpoint``: look into, check and convert checkpoints.

Commands::

    ls DIR                       tensors (dtype, shape, chunks, bytes) and plain values
    verify DIR                   read every chunk and check its crc32 (exit 1 on any problem)
    to-torch DIR FILE            one torch.save file (torch.load(FILE, weights_only=True))
    from-torch FILE DIR          a checkpoint from a torch.save state dict
    to-safetensors DIR FILE      one flat safetensors file (needs the safetensors package)
    from-safetensors FILE DIR    a checkpoint from a safetensors file
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ringlet.checkpoint import format_utils
from ringlet.checkpoint._metadata import METADATA_FILE, Metadata
from ringlet.checkpoint._storage import read_metadata

__all__ = ["main"]

PROG = "python -m ringlet.distributed.checkpoint"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="List, verify and convert "
                                                       "ringlet checkpoints.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("ls", help="list tensors and values").add_argument("dir")
    sub.add_parser("verify", help="check every chunk's crc32").add_argument("dir")
    for name, a, b in (("to-torch", "dir", "file"), ("from-torch", "file", "dir"),
                       ("to-safetensors", "dir", "file"), ("from-safetensors", "file", "dir")):
        sp = sub.add_parser(name)
        sp.add_argument(a)
        sp.add_argument(b)
    return p


def _ls(directory: str) -> int:
    meta = Metadata.from_json_bytes(read_metadata(directory),
                                    os.path.join(directory, METADATA_FILE))
    width = max([len(k) for k in meta.tensors] + [len(k) for k in meta.values] + [3])
    print(f"{directory}: saved by {meta.world_size} rank(s), save id {meta.save_id}, "
          f"{len(meta.files)} file(s)")
    total = 0
    for key, t in meta.tensors.items():
        total += t.nbytes
        print(f"  {key:<{width}}  {t.dtype:<9} {list(t.shape)!s:<18} {len(t.chunks):>3} chunk(s) "
              f"{t.nbytes:>12} B")
    for key in meta.values:
        print(f"  {key:<{width}}  value     {meta.value(key)!r:.60}")
    print(f"  {len(meta.tensors)} tensor(s), {total} bytes; {len(meta.values)} value(s)")
    return 0


def _verify(directory: str) -> int:
    problems = format_utils.verify(directory)
    for line in problems:
        print(f"BAD  {line}")
    if not problems:
        print(f"OK   {directory}: every chunk's checksum matches")
    return 1 if problems else 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "ls":
            return _ls(args.dir)
        if args.cmd == "verify":
            return _verify(args.dir)
        convert = {"to-torch": format_utils.dcp_to_torch_save,
                   "to-safetensors": format_utils.dcp_to_safetensors,
                   "from-torch": format_utils.torch_save_to_dcp,
                   "from-safetensors": format_utils.safetensors_to_dcp}[args.cmd]
        src, dst = (args.dir, args.file) if args.cmd.startswith("to-") else (args.file, args.dir)
        convert(src, dst)
        print(f"{args.cmd}: {src} -> {dst}")
        return 0
    except (OSError, ValueError, TypeError, RuntimeError, ImportError) as e:
        print(f"{PROG} {args.cmd}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


_TORCH_MODES = {"dcp_to_torch": "to-torch", "torch_to_dcp": "from-torch"}


def format_utils_main(argv: Sequence[str] | None = None) -> None:
    """torch's ``format_utils`` command line: ``MODE SRC DST`` with ``MODE`` one of
    ``dcp_to_torch``/``torch_to_dcp``; the same conversions as ``to-torch``/``from-torch``.
    Exits the interpreter with the status (``SystemExit``), as a ``__main__`` does.

    Example::

        python -m ringlet.distributed.checkpoint.format_utils dcp_to_torch checkpoint model.pth
    """
    p = argparse.ArgumentParser(prog="python -m ringlet.distributed.checkpoint.format_utils",
                                description="Convert a checkpoint to or from one torch.save file.")
    p.add_argument("mode", choices=sorted(_TORCH_MODES), help="conversion mode")
    p.add_argument("src", help="path to the source checkpoint (directory or file)")
    p.add_argument("dst", help="path to write the converted checkpoint to")
    args = p.parse_args(argv)
    raise SystemExit(main([_TORCH_MODES[args.mode], args.src, args.dst]))
