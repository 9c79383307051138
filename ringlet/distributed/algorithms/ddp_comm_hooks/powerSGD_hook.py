# ruff: noqa: N999 - torch's module name
"""``ringlet.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (implemented in
ringlet.parallel.comm_hooks)."""

from ringlet.parallel.comm_hooks.batched_powerSGD import batched_powerSGD_hook
from ringlet.parallel.comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

__all__ = ["PowerSGDState", "batched_powerSGD_hook", "powerSGD_hook"]
