"""Pieces every launch shares: messages, signal bookkeeping, the private run directory, the token.

[Note: run tokens]
The store and the tcp transport authenticate with a run token (HMAC over a nonce).  One node:
the launcher draws a fresh random token per run.  Several nodes: every launcher must hold the
same token, so the user provides it -- ``--rdzv-token-file PATH`` (a file readable only by its
owner, e.g. on a shared home directory or copied to each node), or ``RINGLET_STORE_TOKEN_FILE``
/ ``RINGLET_STORE_TOKEN`` set on every node.  A job whose master address is loopback (all nodes
on one machine) may run without one.  Either way workers never see the token in their
environment: the launcher writes it to a 0600 file in its private run directory and passes
that file's path (``RINGLET_STORE_TOKEN_FILE``).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType

from ringlet.launcher._plan import PROG, LaunchConfig

__all__ = ["Signals", "run_dir", "say", "shared_token"]


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


class Signals:
    """SIGINT/SIGTERM/SIGHUP to the launcher, remembered (first one wins) until checked."""

    HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.received: int | None = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    @contextmanager
    def installed(self) -> Iterator[Signals]:
        previous = {s: signal.signal(s, self._handler) for s in self.HANDLED}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)


@contextmanager
def run_dir(token: bytes | None) -> Iterator[tuple[str, str, bytes | None]]:
    """A private (0700) run directory holding the token in a 0600 file; removed on exit.

    ``token`` None on a single node draws a fresh one; ``b""`` means "no token" (an empty file).
    """
    path = tempfile.mkdtemp(prefix="ringlet-run-")  # mode 0700
    try:
        if token is None:
            # Hex, not raw bytes: readers strip whitespace from the file (_env.store_token).
            token = secrets.token_hex(32).encode()
        token_file = os.path.join(path, "store_token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(token)
        yield path, token_file, token or None
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def shared_token(config: LaunchConfig, env: Mapping[str, str] | None = None) -> bytes:
    """The token every node of a multi-node job shares (see [Note: run tokens]); ``b""`` for none.

    Raises:
        ValueError: no token where one is needed, an empty token file, or a token file that
            others may read (expected mode 0600).
    """
    env = os.environ if env is None else env
    path = config.token_file or env.get("RINGLET_STORE_TOKEN_FILE")
    if path:
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                data = f.read().strip()
        except OSError as e:
            raise ValueError(f"expected a readable run token file, got {path!r} "
                             f"({e.strerror})") from None
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"expected the run token file {path} to be readable by its owner only "
                             f"(chmod 600), got mode {oct(st.st_mode & 0o777)}")
        if not data:
            raise ValueError(f"expected a token in {path}, got an empty file")
        return data
    raw = env.get("RINGLET_STORE_TOKEN")
    if raw:
        return raw.encode()
    if _loopback(config.master_addr):
        return b""
    raise ValueError(
        f"expected a run token shared by the {config.nnodes} nodes, got none: pass "
        "--rdzv-token-file PATH (the same 0600 file on every node; e.g. `python -c 'import "
        "secrets; print(secrets.token_hex(32))' > ~/.ringlet-token && chmod 600 ~/.ringlet-token`) "
        "or set RINGLET_STORE_TOKEN on every node")
