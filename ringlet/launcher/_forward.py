"""Forwarding a worker's output: to the console with a ``[rank<r>]:`` prefix, to its log file, or
both (the plan comes from ``_logs``).

Each stream of each worker has a thread that reads what the pipe holds and writes it to its
sinks; console writes hold one lock so that prefixed lines of different ranks never interleave.
On a terminal the prefix is coloured, one colour per rank (``NO_COLOR`` turns it off).

[Note: live lines]
A progress bar (tqdm) redraws one line: it writes ``\r`` and the new text, without a newline.
When the console is a terminal (``Sink.live``), such an unfinished line (one that a ``\r``
started: plain text still waits for its newline) is shown at once, with
its prefix, and redrawn in place on each update; a complete line from any rank first clears the
open line, prints itself, then redraws the open line below it, so bars and log lines of several
ranks never garble each other.  The launcher tells such workers (``RINGLET_CONSOLE_TTY=1``,
``COLUMNS``) that their output ends on a terminal, since their own stdout is a pipe.  Off a
terminal, output is forwarded line by line, ``\r`` included, as before; log files get the
worker's bytes unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
from typing import IO, BinaryIO

__all__ = ["Sink", "colour_wanted", "prefix", "start_forwarder"]

_OUTPUT_LOCK = threading.Lock()
_COLOURS = (36, 33, 35, 32, 34, 31)   # ANSI cyan, yellow, magenta, green, blue, red
_CLEAR = b"\r\x1b[K"                  # back to column 0, erase the line
_BREAK = re.compile(rb"\r\n|\n|\r")
_open_line: list[tuple[BinaryIO, bytes] | None] = [None]   # (console, prefixed text) being redrawn


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
    # the console is a terminal: redraw unfinished lines ([Note: live lines])
    live: bool = False


def _show_line(sink: Sink, text: bytes) -> None:
    """A complete line, above the open line if any (caller holds the output lock)."""
    console = sink.console
    if console is None:
        return
    is_open = _open_line[0] is not None and _open_line[0][0] is console
    console.write((_CLEAR if is_open else b"") + sink.prefix + text + b"\n")
    if is_open and _open_line[0] is not None:
        console.write(_open_line[0][1])
    console.flush()


def _show_open(sink: Sink, text: bytes) -> None:
    """This worker's unfinished line, drawn in place of the open line (caller holds the lock)."""
    console = sink.console
    if console is None:
        return
    line = sink.prefix + text
    console.write(_CLEAR + line)
    console.flush()
    _open_line[0] = (console, line) if text else None


def _forward_live(stream: IO[bytes], sink: Sink) -> None:
    """Terminal console: lines and in-place redraws ([Note: live lines])."""
    fd, partial, redrawn = stream.fileno(), b"", False   # redrawn: this line had a \r (a bar)
    while data := os.read(fd, 65536):
        if sink.file is not None:
            sink.file.write(data)
            sink.file.flush()
        with _OUTPUT_LOCK:
            pos, pieces = 0, []
            for m in _BREAK.finditer(data):
                pieces.append((data[pos:m.start()], m.group()))
                pos = m.end()
            mine = _open_line[0] is not None and _open_line[0][1] == sink.prefix + partial
            for text, brk in pieces:
                partial += text
                if brk == b"\r":
                    partial, redrawn = b"", True     # a redraw follows
                    continue
                redrawn = False
                if mine:
                    _open_line[0] = None      # this line is finished: it prints as a line
                    mine = False
                    sink.console.write(_CLEAR) if sink.console is not None else None
                _show_line(sink, partial)
                partial = b""
            partial += data[pos:]
            if redrawn and (partial or mine):   # plain text waits for its newline
                _show_open(sink, partial)
    if partial:
        with _OUTPUT_LOCK:
            if _open_line[0] is not None and _open_line[0][1] == sink.prefix + partial:
                _open_line[0] = None
                if sink.console is not None:
                    sink.console.write(_CLEAR)
            _show_line(sink, partial)


def _forward_lines(stream: IO[bytes], sink: Sink) -> None:
    for line in iter(stream.readline, b""):
        if sink.file is not None:
            sink.file.write(line)
            sink.file.flush()
        if not line.endswith(b"\n"):
            line += b"\n"
        if sink.console is not None:
            with _OUTPUT_LOCK:
                _show_line(sink, line[:-1])


def _forward(stream: IO[bytes], sink: Sink) -> None:
    try:
        if sink.live and sink.console is not None:
            _forward_live(stream, sink)
        else:
            _forward_lines(stream, sink)
    except (OSError, ValueError):
        pass  # the sink or the pipe went away while the launcher shuts down
    finally:
        stream.close()
        if sink.file is not None:
            sink.file.close()


def start_forwarder(stream: IO[bytes], sink: Sink, name: str) -> threading.Thread:
    t = threading.Thread(target=_forward, args=(stream, sink), name=name, daemon=True)
    t.start()
    return t
