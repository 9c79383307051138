"""Process groups and collectives (the c10d layer): ringlet's own implementation."""

from ringlet.c10d import collectives as _collectives
from ringlet.c10d import p2p as _p2p
from ringlet.c10d.backend import (
    Backend,
    is_backend_available,
    is_gloo_available,
    is_mpi_available,
    is_nccl_available,
    is_ucc_available,
    is_xccl_available,
)
from ringlet.c10d.buffers import comm_buffer, is_comm_buffer
from ringlet.c10d.coalescing import _coalescing_manager
from ringlet.c10d.collectives import (
    _all_gather_base,
    _reduce_scatter_base,
    all_gather,
    all_gather_coalesced,
    all_gather_into_tensor,
    all_reduce,
    all_reduce_coalesced,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    gather,
    monitored_barrier,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
)
from ringlet.c10d.group import ProcessGroup
from ringlet.c10d.helpers import (
    breakpoint,
    default_pg_timeout,
    get_node_local_rank,
    is_torchelastic_launched,
)
from ringlet.c10d.objects import (
    all_gather_object,
    broadcast_object_list,
    gather_object,
    recv_object_list,
    scatter_object_list,
    send_object_list,
)
from ringlet.c10d.options import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from ringlet.c10d.p2p import P2POp, batch_isend_irecv, irecv, isend, recv, send
from ringlet.c10d.pg_methods import install_functional_api as _install
from ringlet.c10d.reduce_op import ReduceOp, _make_nccl_premul_sum, reduce_op
from ringlet.c10d.subgroups import new_subgroups, new_subgroups_by_enumeration, split_group
from ringlet.c10d.tools import agree, report_stragglers, stats
from ringlet.c10d.work import Work
from ringlet.c10d.world import (
    GroupMember,
    destroy_process_group,
    get_backend,
    get_default_backend_for_device,
    get_global_rank,
    get_group_rank,
    get_process_group_ranks,
    get_rank,
    get_world_size,
    group,
    init_process_group,
    is_available,
    is_initialized,
    new_group,
)
from ringlet.c10d.world_info import (
    DebugLevel,
    get_debug_level,
    get_pg_count,
    set_debug_level,
    set_debug_level_from_env,
)

_install(_collectives, _p2p)     # ProcessGroup's torch-style methods run these

# Grouped by kind (process groups, then operations and their types); see ringlet.distributed.
__all__ = [  # noqa: RUF022
    # process groups
    "init_process_group", "destroy_process_group", "is_initialized", "is_available", "get_rank",
    "get_world_size", "get_backend", "get_default_backend_for_device", "new_group", "new_subgroups",
    "new_subgroups_by_enumeration", "get_process_group_ranks", "get_global_rank", "get_group_rank",
    "group", "GroupMember", "ProcessGroup", "get_pg_count",
    # backends, debugging, launch environment
    "Backend", "is_backend_available", "is_gloo_available", "is_mpi_available", "is_nccl_available",
    "is_ucc_available", "is_xccl_available", "DebugLevel", "get_debug_level", "set_debug_level",
    "set_debug_level_from_env", "breakpoint", "default_pg_timeout", "get_node_local_rank",
    "is_torchelastic_launched",
    # torch's option objects for ProcessGroup methods
    "AllgatherOptions", "AllreduceCoalescedOptions", "AllreduceOptions", "AllToAllOptions",
    "BarrierOptions", "BroadcastOptions", "GatherOptions", "ReduceOptions", "ReduceScatterOptions",
    "ScatterOptions",
    # collectives, point-to-point, objects, debugging
    "P2POp", "ReduceOp", "Work", "_make_nccl_premul_sum", "agree", "all_gather",
    "all_gather_coalesced", "all_gather_into_tensor", "all_gather_object", "all_reduce",
    "all_reduce_coalesced", "all_to_all", "all_to_all_single", "barrier", "batch_isend_irecv",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend",
    "monitored_barrier", "recv", "recv_object_list", "reduce", "reduce_op", "reduce_scatter",
    "reduce_scatter_tensor", "report_stragglers", "scatter", "scatter_object_list", "send",
    "send_object_list", "stats", "split_group", "_coalescing_manager", "_all_gather_base",
    "_reduce_scatter_base",
    # ringlet's own: communication buffers in shared memory
    "comm_buffer", "is_comm_buffer",
]
