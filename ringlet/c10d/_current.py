"""Which world the caller is in: the process's, or (ranks as threads) the calling thread's.

A leaf module, so that low layers of c10d (argument checks naming the calling rank in their
errors) can ask for the current world without importing ``world.py``, which builds on them.
``world.py`` owns the worlds themselves; this module only remembers which one is current.
"""

from __future__ import annotations

import contextvars
from typing import TYPE_CHECKING, Literal, overload

if TYPE_CHECKING:
    from ringlet.c10d.world import _World

__all__ = ["current_world"]

_process_world: list[_World | None] = [None]
_thread_world: contextvars.ContextVar[_World | None] = contextvars.ContextVar("ringlet_world",
                                                                              default=None)
# ringlet.testing.run_threads sets this in each rank thread: worlds then live per thread
_thread_mode: contextvars.ContextVar[bool] = contextvars.ContextVar("ringlet_thread_mode",
                                                                    default=False)


@overload
def current_world(required: Literal[True] = True) -> _World: ...
@overload
def current_world(required: bool) -> _World | None: ...


def current_world(required: bool = True) -> _World | None:
    """The caller's world; ``None`` (or torch's error when ``required``) before init."""
    w = _thread_world.get() if _thread_mode.get() else _process_world[0]
    if w is None and required:
        raise ValueError("Default process group has not been initialized, please make sure to call "
                         "init_process_group.")
    return w


def _set_world(w: _World | None) -> None:
    if _thread_mode.get():
        _thread_world.set(w)
    else:
        _process_world[0] = w
