"""``ringlet.distributed.algorithms.ddp_comm_hooks.debugging_hooks`` (implemented in
ringlet.parallel.comm_hooks)."""

from ringlet.parallel.comm_hooks.registry import noop_hook

__all__ = ["noop_hook"]
