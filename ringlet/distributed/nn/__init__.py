"""``ringlet.distributed.nn``: torch's ``torch.distributed.nn`` (re-exports only).

The collectives that autograd differentiates, also published here by torch, and the
``functional`` module that holds them.  torch's ``RemoteModule`` needs RPC, which ringlet does
not provide.
"""

from ringlet.distributed.nn import functional
from ringlet.distributed.nn.functional import (
    all_gather,
    all_reduce,
    all_to_all,
    all_to_all_single,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "functional",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]
