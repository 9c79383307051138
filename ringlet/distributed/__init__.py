"""``ringlet.distributed``: torch.distributed's public API, implemented by ringlet.

Migrate a script by replacing ``torch.distributed`` with ``ringlet.distributed``.
This module only re-exports; the implementation lives in ``ringlet.c10d``
(process groups), ``ringlet.store`` and ``ringlet.transport``.
"""

from ringlet.c10d import *
from ringlet.c10d import __all__ as _c10d_all
from ringlet.c10d.collectives import all_gather_into_tensor as all_gather_single
from ringlet.c10d.collectives import reduce_scatter_tensor as reduce_scatter_single
from ringlet.c10d.world_info import (  # noqa: F401 - torch's private names that scripts call
    _get_default_group,
    _get_pg_config,
    _rank_not_in_group,
)
from ringlet.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistBackendError,
    DistError,
    DistNetworkError,
    DistStoreError,
    GroupAbortedError,
    PeerFailureError,
    QueueEmptyError,
)
from ringlet.mesh import DeviceMesh, init_device_mesh
from ringlet.parallel.ddp import GradBucket
from ringlet.store import FileStore, HashStore, PrefixStore, Store, TCPStore

__all__ = [
    *_c10d_all, "all_gather_single", "reduce_scatter_single", "DistError", "DistBackendError",
    "DistNetworkError", "DistStoreError", "CollectiveTimeoutError", "CollectiveMismatchError",
    "PeerFailureError", "GroupAbortedError", "TCPStore", "FileStore", "HashStore", "PrefixStore", "Store",
    "DeviceMesh", "init_device_mesh", "GradBucket", "QueueEmptyError", "distributed_c10d",
]

from ringlet.distributed import distributed_c10d  # the submodule, after the names it re-exports
