"""``ringlet.distributed.fsdp._fully_shard._fsdp_api``: torch's FSDP2 policy and comm classes.

Re-exports only (``ringlet.parallel.fsdp.policies`` and ``ringlet.parallel.fsdp._comm_api``).
"""

from ringlet.parallel.fsdp._comm_api import *
from ringlet.parallel.fsdp._comm_api import __all__ as _comm_all
from ringlet.parallel.fsdp.policies import *
from ringlet.parallel.fsdp.policies import __all__ as _policies_all

__all__ = [*_comm_all, *_policies_all]
