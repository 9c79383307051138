"""``ringlet.distributed``: torch.distributed's public API, implemented by ringlet.

Migrate a script by replacing ``torch.distributed`` with ``ringlet.distributed``.
This module only re-exports; the implementation lives in ``ringlet.c10d``
(process groups), ``ringlet.store`` and ``ringlet.transport``.  Its names are the lists of
the packages it re-exports (each kept once, in that package's ``__all__``), plus torch's
aliases ``all_gather_single`` / ``reduce_scatter_single``, ``GradBucket`` (DDP's, which torch
also publishes here) and the ``distributed_c10d`` submodule.
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
from ringlet.distributed import distributed_c10d
from ringlet.errors import *
from ringlet.errors import __all__ as _errors_all
from ringlet.mesh import *
from ringlet.mesh import __all__ as _mesh_all
from ringlet.parallel.ddp import GradBucket
from ringlet.store import *
from ringlet.store import __all__ as _store_all

__all__ = [*_c10d_all, *_errors_all, *_store_all, *_mesh_all, "GradBucket", "all_gather_single",
           "reduce_scatter_single", "distributed_c10d"]
