"""Checks ``ringlet-run`` makes before it starts anything: is there something to run?

A misspelled script path used to surface only once every worker had started its interpreter
(seconds, several tracebacks); the launcher now looks first, in its own process, without
importing anything:

* a script: the path exists, is a regular file and is readable (close names in its folder are
  suggested);
* ``-m module``: the top-level package is found on the workers' module path (the launcher's
  working directory first, as ``python -m`` does), without importing it;
* ``--no-python``: the command is an executable file or found on ``PATH``.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import shutil
import sys

from ringlet.launcher._plan import LaunchConfig

__all__ = ["check_entrypoint"]


def check_entrypoint(config: LaunchConfig) -> str | None:
    """Why the workers of ``config`` could not start their entry point, or None when they can."""
    if config.module:
        return _check_module(config.entrypoint)
    if config.no_python:
        return _check_command(config.entrypoint)
    return _check_script(config.entrypoint)


def _check_script(path: str) -> str | None:
    where = os.path.abspath(path)
    if not os.path.exists(path):
        return f"training script {path!r} not found ({where}){_close_names(path)}"
    if not os.path.isfile(path):
        return f"training script {path!r}: expected a file, got a folder or special file ({where})"
    if not os.access(path, os.R_OK):
        return f"training script {path!r}: expected a readable file, got no read permission"
    return None


def _close_names(path: str) -> str:
    folder = os.path.dirname(path) or "."
    try:
        names = [n for n in os.listdir(folder) if n.endswith(".py")]
    except OSError:
        return f"; folder {folder!r} cannot be listed"
    close = difflib.get_close_matches(os.path.basename(path), names, n=3)
    return f"; did you mean {', '.join(repr(os.path.join(folder, c)) for c in close)}?" if close \
        else ""


def _check_module(name: str) -> str | None:
    top = name.split(".")[0]
    if not top.isidentifier():
        return f"-m {name!r}: expected a module name such as pkg.train, got {name!r}"
    # Only the top level: finding a submodule would import its parent packages (maybe torch).
    # Every finder is asked (editable installs add their own), with the working directory first
    # on the path, as ``python -m`` puts it for the workers.
    saved = sys.path[:]
    sys.path[:] = [os.getcwd(), *saved[1:]]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None:
        return (f"-m {name!r}: no module named {top!r} on the workers' path (the working "
                f"directory {os.getcwd()!r}, PYTHONPATH and site-packages)")
    return None


def _check_command(command: str) -> str | None:
    if os.sep in command:
        if os.path.isfile(command) and os.access(command, os.X_OK):
            return None
        return f"--no-python command {command!r}: expected an executable file, got none there"
    if shutil.which(command) is None:
        return f"--no-python command {command!r} not found on PATH"
    return None
