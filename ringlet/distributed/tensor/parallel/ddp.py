"""``ringlet.distributed.tensor.parallel.ddp``: torch's private helpers for DDP over DTensor
parameters.

Re-exports only; the implementation is ``ringlet.parallel.ddp._tp``.
"""

from ringlet.parallel.ddp._tp import (
    _get_submodule_n_params,
    _localize_dtensor,
    _pre_dp_module_transform,
    _reconstruct_dtensor,
    _update_module_param,
)

__all__ = ["_get_submodule_n_params", "_localize_dtensor", "_pre_dp_module_transform",
           "_reconstruct_dtensor", "_update_module_param"]
