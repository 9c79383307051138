"""torch's module path of ``ShardedGradScaler`` (``torch.distributed.fsdp.sharded_grad_scaler``)."""

from ringlet.parallel.fsdp.sharded_grad_scaler import ShardedGradScaler

__all__ = ["ShardedGradScaler"]
