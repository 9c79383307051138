"""fully_shard (FSDP2): parameters sharded on dim 0 over a DeviceMesh, one
flat collective per group.

Files, in dependency order: ``_shard_math`` (pure shard sizes, padding, flat layouts) ->
``_collectives`` (a group's all-gather / reduce-scatter) -> ``_param`` (one parameter) ->
``_param_group`` (one fully_shard call's group) -> ``_state`` (hooks, training
state, prefetch, the final callback) -> ``_init`` / ``_state_dict`` ->
``_api`` (the public surface).
"""

from ringlet.parallel.fsdp._api import (
           FSDPModule,
           UnshardHandle,
           fully_shard,
           register_fsdp_forward_method,
           share_comm_ctx,
)
from ringlet.parallel.fsdp.policies import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

__all__ = [
           "CPUOffloadPolicy",
           "FSDPModule",
           "MixedPrecisionPolicy",
           "OffloadPolicy",
           "UnshardHandle",
           "fully_shard",
           "register_fsdp_forward_method",
           "share_comm_ctx",
]
