"""``ringlet.distributed.algorithms.ddp_comm_hooks.quantization_hooks`` (implemented in ringlet.parallel.comm_hooks)."""

from ringlet.parallel.comm_hooks.quantization_hooks import (
    quantization_perchannel_hook,
    quantization_pertensor_hook,
)

__all__ = ["quantization_perchannel_hook", "quantization_pertensor_hook"]
