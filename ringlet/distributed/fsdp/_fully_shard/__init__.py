"""``ringlet.distributed.fsdp._fully_shard``: torch's private FSDP2 package path, the same names as
``ringlet.distributed.fsdp`` (re-exports only)."""

from ringlet.distributed.fsdp import *
from ringlet.distributed.fsdp import __all__  # noqa: F401
