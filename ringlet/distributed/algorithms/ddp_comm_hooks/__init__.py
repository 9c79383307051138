"""``ringlet.distributed.algorithms.ddp_comm_hooks``: DDP communication hooks (implemented in
ringlet.parallel.comm_hooks).

``default_hooks`` (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``fp16_compress_wrapper``, ``bf16_compress_wrapper``), ``powerSGD_hook`` (``PowerSGDState``,
``powerSGD_hook``, ``batched_powerSGD_hook``), ``quantization_hooks``, ``debugging_hooks``
(``noop_hook``), and ``DDPCommHookType`` / ``register_ddp_comm_hook``.
"""

from ringlet.distributed.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    powerSGD_hook,
    quantization_hooks,
)
from ringlet.parallel.comm_hooks.registry import DDPCommHookType, register_ddp_comm_hook

__all__ = ["DDPCommHookType", "debugging_hooks", "default_hooks", "powerSGD_hook",
           "quantization_hooks", "register_ddp_comm_hook"]
