"""``record``: write a worker's exception where its launcher looks for it (torch's ``@record``).

Published scripts decorate their entry point::

    from ringlet.distributed.elastic.multiprocessing.errors import record

    @record
    def main(): ...

When the decorated function raises, the exception and its traceback are written as JSON to
``TORCHELASTIC_ERROR_FILE`` (set by ``ringlet-run`` and by torchrun; the record carries both
launchers' fields), then re-raised.  The launcher's failure summary then shows that traceback
for the first failing rank, even when the worker is not started through ringlet's own bootstrap
(``--no-python``, another launcher).  Without the variable the decorator only re-raises.
``SystemExit`` with code 0 (or None) returns None, as in torch; a non-zero exit is re-raised
without a record.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from ringlet.launcher._worker import write_error_file

__all__ = ["ErrorHandler", "get_error_handler", "record"]

_R = TypeVar("_R")


class ErrorHandler:
    """Writes an exception to the error file named by ``TORCHELASTIC_ERROR_FILE``."""

    def initialize(self) -> None:
        """Nothing to set up (torch installs faulthandler here; ringlet's bootstrap already did)."""

    def record_exception(self, e: BaseException) -> None:
        """Write ``e`` with its traceback to the error file, if the launcher asked for one."""
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        if not path:
            return
        try:
            write_error_file(path, e, e.__traceback__)
        except OSError as err:
            print(f"ringlet: could not write error file {path}: {err}", file=sys.stderr)


def get_error_handler() -> ErrorHandler:
    """A fresh :class:`ErrorHandler` (torch's factory of the same name), for ``record(fn,
    error_handler=...)``."""
    return ErrorHandler()


def record(fn: Callable[..., _R],
           error_handler: ErrorHandler | None = None) -> Callable[..., _R | None]:
    """Decorate a worker's entry point so that an exception it raises reaches the launcher's
    failure summary (see the module docstring).

    Args:
        fn: the entry point, typically ``main``.
        error_handler: where to write (default: ``TORCHELASTIC_ERROR_FILE``).

    Returns:
        ``fn`` wrapped: same result, exceptions recorded then re-raised.

    Example::

        @record
        def main() -> None:
            dist.init_process_group()
            train()

        if __name__ == "__main__":
            main()
    """
    handler = error_handler or get_error_handler()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _R | None:
        handler.initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as e:
            if e.code in (0, None):
                return None
            raise
        except Exception as e:
            handler.record_exception(e)
            raise

    return wrapper
