"""``ringlet.distributed.tensor.parallel.style``: torch's module of the parallel styles (re-exports only)."""

from ringlet.parallel.tensor_parallel._prepare import *
from ringlet.parallel.tensor_parallel.style import *

__all__ = ["ColwiseParallel", "ParallelStyle", "PrepareModuleInput", "PrepareModuleInputOutput",
           "PrepareModuleOutput", "RowwiseParallel", "SequenceParallel"]
