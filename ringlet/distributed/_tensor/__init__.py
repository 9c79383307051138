"""``ringlet.distributed._tensor``: the legacy path of ``ringlet.distributed.tensor`` (re-exports only)."""

from ringlet.distributed.tensor import *
from ringlet.distributed.tensor import __all__  # noqa: F401
