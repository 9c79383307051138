"""``ringlet.distributed.tensor.parallel._data_parallel_utils``: torch's private DTensor flatten/unflatten.

Re-exports only; the implementation is ``ringlet.parallel._data_parallel_utils``.
"""

from ringlet.parallel._data_parallel_utils import _flatten_tensor, _unflatten_tensor, sync_grad_hook

__all__ = ["_flatten_tensor", "_unflatten_tensor", "sync_grad_hook"]
