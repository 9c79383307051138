"""``ringlet.distributed.checkpoint.state_dict``: torch's state-dict API (re-exports only).

Also re-exports torch's private ``_init_optim_state``, which published scripts import.
"""

from ringlet.checkpoint.state_dict import *
from ringlet.checkpoint.state_dict import (
    __all__,  # noqa: F401
    _init_optim_state,  # noqa: F401
)
