"""``ringlet.distributed.tensor.parallel.loss``: ``loss_parallel`` (re-exports only)."""

from ringlet.parallel.tensor_parallel.loss import loss_parallel

__all__ = ["loss_parallel"]
