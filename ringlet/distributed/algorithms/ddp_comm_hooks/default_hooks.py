"""``ringlet.distributed.algorithms.ddp_comm_hooks.default_hooks`` (implemented in
ringlet.parallel.comm_hooks)."""

from ringlet.parallel.comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
)

__all__ = [
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]
