"""``ringlet.distributed.fsdp._fully_shard._fsdp_api``: torch's FSDP2 policy and comm classes (re-exports only)."""

from ringlet.parallel.fsdp._comm_api import AllGather, Comm, ReduceScatter
from ringlet.parallel.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = ["AllGather", "CPUOffloadPolicy", "Comm", "MixedPrecisionPolicy", "OffloadPolicy", "ReduceScatter"]
