"""Host secrets: how ranks of one host authenticate to a store started without a run token.

[Note: host secret]
A ``TCPStore`` master given no run token draws a random secret and writes it to a file that
only its user can read: ``<dir>/store-<id>.secret``, mode 0600, in a directory of mode 0700
owned by that user (``RINGLET_RUNTIME_DIR``, default ``/tmp/ringlet-<uid>``).  The server's
greeting names the file by ``<id>`` (the id is not secret; the file's content is).  A client
that holds no token reads the file of that id from *its own* user's directory, so:

* every process of the job's user on the job's host finds it and authenticates, with no user
  action (``env://`` or ``tcp://`` by hand, ``mp.spawn``, several launchers on one machine);
* a process of another user looks in another directory, and could not read this one anyway;
* a process on another host (or without the directory) has no file: it is refused, with a
  message saying that jobs spanning hosts need a shared run token.

The handshake then proves the secret with the same HMAC as a run token, and the tcp transport
keys its own handshake with it (``effective_token``), so a process that merely reached the
store's port can neither read the store nor join the mesh.  The master removes the file when
its server stops; files of masters that died are removed by the next master of that user.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat

from ringlet import _env
from ringlet.errors import DistStoreError

__all__ = ["create_secret", "read_secret", "remove_secret", "secret_dir"]

_ID = re.compile(r"^(\d+)-[0-9a-f]{16}$")
ID_BYTES = 24     # room for "<pid>-<16 hex>" in the server's greeting


def secret_dir(create: bool) -> str | None:
    """This user's private directory for host secrets (created 0700 when ``create``).

    Returns None when it does not exist and ``create`` is false.

    Raises:
        DistStoreError: the path exists but is not a directory of this user with mode 0700
            (someone else created it: refusing to put or read a secret there).
    """
    path = _env.runtime_dir() or f"/tmp/ringlet-{os.geteuid()}"
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise DistStoreError(
            f"host secret directory {path}: expected a directory owned by uid {os.geteuid()} with "
            f"mode 0700, got uid {st.st_uid} mode {oct(st.st_mode & 0o7777)} "
            f"({'not a directory' if not stat.S_ISDIR(st.st_mode) else 'someone else may read it'})"
            "; remove it or set RINGLET_RUNTIME_DIR", path=path)
    return path


def _sweep(path: str) -> None:
    """Remove the secrets of masters that died (same user, name checked, creator pid gone)."""
    for name in os.listdir(path):
        m = _ID.match(name.removeprefix("store-").removesuffix(".secret"))
        if m is None or not name.startswith("store-") or not name.endswith(".secret"):
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, name))
        except PermissionError:
            pass   # alive, another user's pid (cannot happen in a 0700 dir, but never remove)


def create_secret() -> tuple[str, bytes]:
    """A fresh secret in a new 0600 file; returns (id, secret)."""
    path = secret_dir(create=True)
    if path is None:
        raise AssertionError("secret_dir(create=True) returned no directory")
    _sweep(path)
    sid = f"{os.getpid()}-{secrets.token_hex(8)}"
    secret = secrets.token_hex(32).encode()
    fd = os.open(os.path.join(path, f"store-{sid}.secret"),
                 os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    return sid, secret


def read_secret(sid: str) -> bytes | None:
    """The secret of ``sid`` from this user's directory, or None when this
    process cannot have it."""
    if not _ID.match(sid):
        return None
    try:
        path = secret_dir(create=False)
    except DistStoreError:
        return None
    if path is None:
        return None
    try:
        fd = os.open(os.path.join(path, f"store-{sid}.secret"),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            return None
        return f.read(256).strip() or None


def remove_secret(sid: str) -> None:
    with contextlib.suppress(OSError, DistStoreError):
        path = secret_dir(create=False)
        if path is not None and _ID.match(sid):
            os.unlink(os.path.join(path, f"store-{sid}.secret"))
