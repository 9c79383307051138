"""Forwarding a worker's output: to the console with a ``[rank<r>]:`` prefix, to its log file, or
both (the plan comes from ``_logs``).

Each stream of each worker has a thread that reads whole lines from the pipe and writes them to
its sinks; console writes hold one lock so that prefixed lines of different ranks never
interleave.  On a terminal the prefix is coloured, one colour per rank (``NO_COLOR`` turns it off).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import BinaryIO

__all__ = ["Sink", "colour_wanted", "prefix", "start_forwarder"]

_OUTPUT_LOCK = threading.Lock()
_COLOURS = (36, 33, 35, 32, 34, 31)   # ANSI cyan, yellow, magenta, green, blue, red


def colour_wanted(stream: object) -> bool:
    """Colour a console stream: a terminal, and ``NO_COLOR`` unset (no-color.org)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty()) and not os.environ.get("NO_COLOR")


def prefix(rank: int, colour: bool) -> bytes:
    """``[rank3]: ``, coloured when ``colour``."""
    text = f"[rank{rank}]:"
    if colour:
        text = f"\x1b[{_COLOURS[rank % len(_COLOURS)]}m{text}\x1b[0m"
    return (text + " ").encode()


@dataclasses.dataclass
class Sink:
    """Where one stream of one worker goes."""

    console: BinaryIO | None   # None: not shown (redirected, or filtered out)
    prefix: bytes
    file: BinaryIO | None      # the worker's log file for this stream, or None


def _forward(stream: BinaryIO, sink: Sink) -> None:
    try:
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            if sink.file is not None:
                sink.file.write(line)
                sink.file.flush()
            if sink.console is not None:
                with _OUTPUT_LOCK:
                    sink.console.write(sink.prefix + line)
                    sink.console.flush()
    except (OSError, ValueError):
        pass  # the sink or the pipe went away while the launcher shuts down
    finally:
        stream.close()
        if sink.file is not None:
            sink.file.close()


def start_forwarder(stream: BinaryIO, sink: Sink, name: str) -> threading.Thread:
    t = threading.Thread(target=_forward, args=(stream, sink), name=name, daemon=True)
    t.start()
    return t
