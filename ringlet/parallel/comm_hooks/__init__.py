"""DDP communication hooks: ``default_hooks`` (all-reduce, fp16/bf16 compression), ``powerSGD_hook``
(and ``batched_powerSGD``), ``quantization_hooks`` and the ``registry`` (``DDPCommHookType``,
``register_ddp_comm_hook``, ``noop_hook``).

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``: it receives a
``GradBucket`` (``index()``, ``buffer()``, ``gradients()``, ``parameters()``,
``is_last()``, ``set_buffer(t)``), starts the communication of the bucket's
flattened gradients and returns a future of the tensor that replaces them.
"""

from ringlet.parallel.comm_hooks import (
           batched_powerSGD,
           default_hooks,
           powerSGD_hook,
           quantization_hooks,
)
from ringlet.parallel.comm_hooks.registry import DDPCommHookType, noop_hook, register_ddp_comm_hook

__all__ = ["DDPCommHookType", "batched_powerSGD", "default_hooks", "noop_hook", "powerSGD_hook",
           "quantization_hooks", "register_ddp_comm_hook"]
