"""``ringlet.distributed.tensor.parallel``: torch's ``torch.distributed.tensor.parallel`` (re-exports only).

The implementation lives in ``ringlet.parallel.tensor_parallel`` (layer 7).
"""

from ringlet.parallel.tensor_parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "loss_parallel",
    "parallelize_module",
]
