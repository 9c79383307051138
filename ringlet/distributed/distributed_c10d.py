"""``ringlet.distributed.distributed_c10d``: mirror of ``torch.distributed.distributed_c10d``.

Re-exports only: the public process-group API (as ``ringlet.distributed``) plus the private
helpers that published code reaches for through this path (``_get_default_group``,
``_rank_not_in_group``, ``_get_pg_config``, ``_get_process_group_name``).
"""

from ringlet.c10d import *
from ringlet.c10d import __all__ as _c10d_all
from ringlet.c10d.world_info import (
    _get_default_group,
    _get_pg_config,
    _get_process_group_name,
    _rank_not_in_group,
)

__all__ = [*_c10d_all, "_get_default_group", "_get_pg_config", "_get_process_group_name",
           "_rank_not_in_group"]
