"""``ringlet.distributed.fsdp``: torch's ``torch.distributed.fsdp`` (FSDP2's ``fully_shard``).

Re-exports ``ringlet.parallel.fsdp`` and its ``__all__``, the one list of these names.
"""

from ringlet.parallel.fsdp import *
from ringlet.parallel.fsdp import __all__  # noqa: F401
