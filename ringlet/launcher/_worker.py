"""In-worker bootstrap: ``python .../launcher/_worker.py [-m | --no-python] TARGET ARGS...``.

The launcher starts every worker through this file, which, before the user's code runs:

1. asks the kernel to SIGKILL this process when its parent dies (``PR_SET_PDEATHSIG``),
   then checks the parent is still the launcher (``RINGLET_LAUNCHER_PID``), which closes
   the race of a launcher that died before the request was made;
2. enables ``faulthandler`` (a crash prints the Python stack before the signal kills us);
3. installs an excepthook that writes the uncaught exception as JSON (rank, pid,
   timestamp, traceback) to ``TORCHELASTIC_ERROR_FILE``, which the launcher's failure
   summary reads;
4. runs the target: a script with ``runpy.run_path(..., run_name="__main__")`` (so
   ``sys.modules["__main__"]`` is the script and ``multiprocessing``'s spawn re-imports it),
   a module with ``runpy.run_module(..., alter_sys=True)``, or, with ``--no-python``,
   ``execvp`` of a command (the death signal survives ``exec``).

Only the standard library is imported here, and the file is run by its path, not as
``-m ringlet.launcher._worker``: that would import the ``ringlet`` package, and with it torch,
before the user's first line (seconds per worker, even for a script that never imports torch).
``python -m ringlet.launcher._worker`` works too.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import runpy
import signal
import struct
import sys
import time
import traceback
from types import TracebackType

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux only).

    The signal follows the parent *thread* that forked us, which is why the launcher
    spawns workers from its main thread.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _exit_if_orphaned() -> None:
    expected = os.environ.get("RINGLET_LAUNCHER_PID")
    if expected and os.getppid() != int(expected):
        # The launcher died between our fork and the prctl above: nobody will reap or
        # stop us, so leave now rather than run a job that no longer exists.
        os._exit(1)


def _frame_file(tb: TracebackType) -> str:
    name = tb.tb_frame.f_code.co_filename
    return name if name.startswith("<") else os.path.abspath(name)


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    # Drop this bootstrap's and runpy's frames, so the report starts in the user's code.
    # runpy is frozen into the interpreter since 3.11: its frames say "<frozen runpy>".
    skip = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}
    while tb is not None and _frame_file(tb) in skip:
        if tb.tb_next is None:
            break
        tb = tb.tb_next
    return tb


# ringlet's package and torch's: the frames an error raised by ringlet passes through below the
# user's last line (DTensor ops reach ringlet through torch's dispatch).
_LIBRARY_DIRS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep,)
TRIMMED_NOTE = ("(ringlet's own frames below your last line are hidden; "
                "RINGLET_DEBUG=DETAIL shows them)")


def _in_library(tb: TracebackType, dirs: tuple[str, ...]) -> bool:
    return _frame_file(tb).startswith(dirs)


def _trim_library_tail(exc: BaseException, tb: TracebackType | None) -> TracebackType | None:
    """An error raised inside ringlet ends the traceback at the user's last line: the frames
    below it (ringlet's, and torch's on the way to ringlet) tell a user nothing they can act on,
    and the message names the op, the argument and the rank.  Kept whole under
    ``RINGLET_DEBUG=DETAIL`` (or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``)."""
    debug = os.environ.get("RINGLET_DEBUG") or os.environ.get("TORCH_DISTRIBUTED_DEBUG") or ""
    if tb is None or debug.upper() == "DETAIL":
        return tb
    frames = []
    t: TracebackType | None = tb
    while t is not None:
        frames.append(t)
        t = t.tb_next
    if not _in_library(frames[-1], _LIBRARY_DIRS):
        return tb                       # raised in the user's code (or another library's)
    torch_dir = _torch_dir()
    dirs = _LIBRARY_DIRS + ((torch_dir,) if torch_dir else ())
    last_user = max((i for i, f in enumerate(frames) if not _in_library(f, dirs)), default=-1)
    if last_user < 0 or last_user == len(frames) - 1:
        return tb
    # Cut the chain after the user's frame: a traceback is a linked list of new objects here,
    # rebuilt from the user's frames so the exception's own traceback is left as it was.
    cut: TracebackType | None = None
    for f in reversed(frames[:last_user + 1]):
        cut = TracebackType(cut, f.tb_frame, f.tb_lasti, f.tb_lineno)
    if hasattr(exc, "add_note") and TRIMMED_NOTE not in getattr(exc, "__notes__", ()):
        exc.add_note(TRIMMED_NOTE)
    return cut


def _torch_dir() -> str | None:
    mod = sys.modules.get("torch")
    path = getattr(mod, "__file__", None)
    return os.path.dirname(os.path.abspath(path)) + os.sep if path else None


def write_error_file(path: str, exc: BaseException, tb: TracebackType | None) -> None:
    """Write one exception as JSON to ``path`` (atomically: temp file + rename).

    The record is readable by both launchers: ringlet's fields at the top level, and torch
    elastic's ``{"message": {"message", "extraInfo": {"py_callstack", "timestamp"}}}``.
    """
    now = time.time()
    text = "".join(traceback.format_exception(type(exc), exc,
                                              _trim_library_tail(exc, _user_traceback(tb))))
    record = {
        "rank": int(os.environ.get("RANK", "-1")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "-1")),
        "pid": os.getpid(),
        "timestamp": now,
        "exc_type": type(exc).__qualname__,
        "traceback": text,
        "message": {"message": f"{type(exc).__name__}: {exc}",
                    "extraInfo": {"py_callstack": text, "timestamp": str(int(now))}},
    }
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def install_excepthook() -> None:
    """Record uncaught exceptions to ``TORCHELASTIC_ERROR_FILE``, then print them as usual."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    previous = sys.excepthook

    def hook(
        exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        try:
            write_error_file(path, exc, tb)
        except OSError as err:
            print(f"ringlet: could not write error file {path}: {err}", file=sys.stderr)
        if previous is sys.__excepthook__:
            # The default hook prints exc.__traceback__ whatever tb it is given.
            shown = _trim_library_tail(exc, _user_traceback(tb))
            traceback.print_exception(exc_type, exc, shown, file=sys.stderr)
        else:
            previous(exc_type, exc, tb)

    sys.excepthook = hook


def _first_on_path(folder: str) -> None:
    """What python puts first on ``sys.path`` for the user's target, in place of this file's
    folder (or the working directory under ``-m``); nothing in safe-path mode (``-P``)."""
    if not sys.flags.safe_path:
        sys.path[0] = folder


def _run_script(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    # As ``python script.py`` does: the script's directory comes first on sys.path.
    _first_on_path(os.path.dirname(os.path.abspath(path)))
    runpy.run_path(path, run_name="__main__")


def _run_module(name: str, args: list[str]) -> None:
    sys.argv = [name, *args]  # run_module replaces argv[0] with the module's file
    _first_on_path(os.getcwd())   # as ``python -m`` does
    runpy.run_module(name, run_name="__main__", alter_sys=True)


def _heartbeat_done() -> None:
    """The user's code is over: tell a launcher watching heartbeats to stop watching (writes
    ``ringlet._heartbeat.DONE``, -1, into the counter; not imported: it is in the ringlet
    package)."""
    path = os.environ.get("RINGLET_HEARTBEAT_FILE")
    if not path:
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        os.pwrite(fd, struct.pack("=q", -1), 0)
    except OSError:
        pass
    finally:
        os.close(fd)


def main(argv: list[str]) -> None:
    if not argv or (argv[0] in ("-m", "--no-python") and len(argv) < 2):
        raise SystemExit("usage: python .../ringlet/launcher/_worker.py [-m | --no-python] "
                         "TARGET ...")
    set_parent_death_signal()
    _exit_if_orphaned()
    install_excepthook()
    if argv[0] == "--no-python":
        sys.stdout.flush()
        os.execvp(argv[1], argv[1:])
    faulthandler.enable()
    if os.environ.get("RINGLET_TORCH_DEFAULT") == "1":
        # ringlet-run --torch-backend: importing the package registers torch's "ringlet" backend
        # and makes it the CPU default (ringlet/torch_backend/_register.py::make_default).
        import ringlet  # noqa: F401
    # ringlet-run --heartbeat-timeout asks a hung worker for its stacks before killing it.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        if argv[0] == "-m":
            _run_module(argv[1], argv[2:])
        else:
            _run_script(argv[0], argv[1:])
    finally:   # returned or raised: exiting is not hanging
        _heartbeat_done()


if __name__ == "__main__":
    main(sys.argv[1:])
