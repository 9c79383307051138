"""``ringlet.distributed.algorithms.ddp_comm_hooks.quantization_hooks`` (implemented in
ringlet.parallel.comm_hooks)."""

from ringlet.parallel.comm_hooks.quantization_hooks import *
from ringlet.parallel.comm_hooks.quantization_hooks import __all__  # noqa: F401
