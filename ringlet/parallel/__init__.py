"""Parallel strategies (layer 7): data parallelism and its tools.

Implementation packages behind the public torch-mirror modules:

- ``ringlet.parallel.ddp``: ``DistributedDataParallel``, ``GradBucket`` (DDP
and its comm-hook bucket)
- ``ringlet.parallel.join``: ``Join``, ``Joinable``, ``JoinHook`` (uneven inputs)
- ``ringlet.parallel.comm_hooks``: DDP communication hooks (all-reduce, fp16/bf16, PowerSGD)
- ``ringlet.parallel.sync_batchnorm``: ``SyncBatchNorm``
- ``ringlet.parallel.sampler``: ``DistributedSampler``
- ``ringlet.parallel.zero``: ``ZeroRedundancyOptimizer``
- ``ringlet.parallel.fsdp``: ``fully_shard``, ``FSDPModule``, ``UnshardHandle``, mixed
precision and offload policies
- ``ringlet.parallel.tensor_parallel``: ``parallelize_module``, the parallel
styles, ``loss_parallel``
"""

from ringlet.parallel.ddp import DistributedDataParallel, GradBucket
from ringlet.parallel.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    UnshardHandle,
    fully_shard,
    register_fsdp_forward_method,
)
from ringlet.parallel.join import Join, Joinable, JoinHook
from ringlet.parallel.sampler import DistributedSampler
from ringlet.parallel.sync_batchnorm import SyncBatchNorm
from ringlet.parallel.zero import ZeroRedundancyOptimizer

__all__ = ["DistributedDataParallel", "DistributedSampler", "GradBucket", "Join", "JoinHook",
           "Joinable", "SyncBatchNorm", "ZeroRedundancyOptimizer"]
__all__ += ["CPUOffloadPolicy", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
            "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]
