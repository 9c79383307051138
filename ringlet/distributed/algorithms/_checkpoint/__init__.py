"""torch's ``torch.distributed.algorithms._checkpoint`` package path (activation checkpointing
wrappers, ``checkpoint_wrapper``)."""

__all__: list[str] = []
