"""DDP communication hooks: ``default_hooks`` (all-reduce, fp16/bf16 compression) and ``powerSGD_hook``.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``: it receives a
``GradBucket`` (``index()``, ``buffer()``, ``gradients()``, ``parameters()``,
``is_last()``, ``set_buffer(t)``), starts the communication of the bucket's
flattened gradients and returns a future of the tensor that replaces them.
"""

from ringlet.parallel.comm_hooks import default_hooks, powerSGD_hook

__all__ = ["default_hooks", "powerSGD_hook"]
