"""Names of ringlet's shared-memory segments, and the sweep that removes those left behind.

A leaf module (standard library only) so that both the ``shm`` transport, which creates the
segments, and the launcher, which must not import torch, can use it.

[Note: segment lifecycle]
A group's creator makes ``/dev/shm/ringlet-<pidns>-<pid>-<random>`` (``O_EXCL``, mode 0600) and
unlinks it as soon as every rank has attached; from then on a crash leaves nothing.  Before that
moment a kill of the creator leaves the name behind (the launcher's SIGKILL at teardown, a rank
killed during set-up).  Such a segment is recognised by its name -- it carries the creator's pid
and pid namespace -- and is removed by :func:`sweep_stale` when its creator is gone: the launcher
sweeps when it tears a generation down, and every new segment's creator sweeps first, so a job
started by hand (``mp.spawn``, ``env://``) also cleans up after an earlier one.  Only segments of
this user, in this pid namespace (where the pid means something), whose creator no longer exists,
are touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat

__all__ = ["SHM_DIR", "SHM_PREFIX", "new_segment_name", "sweep_stale"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "ringlet-"
_NAME = re.compile(r"^ringlet-(\d+)-(\d+)-[0-9a-f]{16}$")


def _pid_namespace() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def new_segment_name() -> str:
    """A fresh, unpredictable segment name that records its creator (pid namespace and pid)."""
    return f"{SHM_PREFIX}{_pid_namespace()}-{os.getpid()}-{secrets.token_hex(8)}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True   # exists, another user's
    try:   # a zombie is gone for our purpose: it will never unlink anything
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove segments left by creators that are gone (see the note); returns the names removed."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    ns, uid, removed = _pid_namespace(), os.geteuid(), []
    for name in names:
        m = _NAME.match(name)
        if m is None or int(m.group(1)) != ns or _alive(int(m.group(2))):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                os.unlink(path)
                removed.append(name)
    return removed
