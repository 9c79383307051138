"""``ringlet.distributed.checkpoint.state_dict``: torch's state-dict API (re-exports only)."""

from ringlet.checkpoint.state_dict import *
from ringlet.checkpoint.state_dict import __all__  # noqa: F401
