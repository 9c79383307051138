"""A worker's progress bar under ringlet-run on a terminal: redrawn in place, never garbled."""

from __future__ import annotations

import os
import pty
import re
import select
import subprocess
import sys
import time

import pytest

WORKER = r"""
import os, sys, time
rank = int(os.environ["RANK"])
print("tty", os.environ.get("RINGLET_CONSOLE_TTY"), os.environ.get("COLUMNS", "?"), flush=True)
if rank == 0:
    for i in range(3):
        sys.stdout.write(f"\rbar {i}/3")
        sys.stdout.flush()
        time.sleep(0.05)
    print("\nafter the bar", flush=True)
"""


def _run_on_a_pty(args: list[str], env: dict[str, str], timeout: float = 60.0) -> bytes:
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                            close_fds=True, env=env)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:          # EIO: the terminal's other side closed
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)
    assert proc.returncode == 0, out.decode(errors="replace")
    return out


@pytest.mark.timeout(90)
def test_bar_is_redrawn_in_place_on_a_terminal(tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "NO_COLOR": "1"}
    out = _run_on_a_pty([sys.executable, "-m", "ringlet.distributed.run", "--nproc-per-node", "2",
                         str(script)], env, timeout=60)
    text = out.decode(errors="replace").replace("\r\n", "\n")
    assert "[rank0]: tty 1" in text and "[rank1]: tty 1" in text, text
    # every redraw goes back to column 0 and erases the line before drawing the next state
    assert "\r\x1b[K[rank0]: bar 0/3" in text and "\r\x1b[K[rank0]: bar 2/3" in text, repr(text)
    assert "[rank0]: after the bar\n" in text, repr(text)
    # plain lines are never drawn unfinished: every rank-1 output is the whole line, newline-ended
    pieces = re.findall(r"\[rank1\]: ([^\n\r\x1b]*)(.)", text, re.DOTALL)
    assert pieces and all(p == ("tty 1 " + p[0].split()[-1], "\n") for p in pieces), repr(text)


@pytest.mark.timeout(90)
def test_off_a_terminal_output_stays_line_by_line(tmp_path) -> None:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    proc = subprocess.run([sys.executable, "-m", "ringlet.distributed.run", "--nproc-per-node", "2",
                           str(script)], capture_output=True, timeout=60)
    text = proc.stdout.decode()
    assert proc.returncode == 0, proc.stderr.decode()
    assert "[rank0]: tty None" in text and "\x1b[K" not in text
    assert "[rank0]: \rbar 0/3\rbar 1/3\rbar 2/3\n" in text, repr(text)
