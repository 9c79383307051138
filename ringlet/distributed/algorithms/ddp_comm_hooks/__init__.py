"""``ringlet.distributed.algorithms.ddp_comm_hooks``: DDP communication hooks (implemented in ringlet.parallel.comm_hooks).

``default_hooks`` (``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``,
``fp16_compress_wrapper``, ``bf16_compress_wrapper``) and ``powerSGD_hook``
(``PowerSGDState``, ``powerSGD_hook``).
"""

from ringlet.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

__all__ = ["default_hooks", "powerSGD_hook"]
