"""Tensor parallelism (layer 7): parallel styles, ``parallelize_module`` and ``loss_parallel``.

The public path is ``ringlet.distributed.tensor.parallel`` (torch's names); see
docs/tensor_parallel.md.
"""

from ringlet.parallel.tensor_parallel._prepare import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
)
from ringlet.parallel.tensor_parallel.api import parallelize_module
from ringlet.parallel.tensor_parallel.loss import loss_parallel
from ringlet.parallel.tensor_parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
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
