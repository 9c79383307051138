"""Tensor parallelism (layer 7): parallel styles, ``parallelize_module`` and ``loss_parallel``.

The public path is ``ringlet.distributed.tensor.parallel`` (torch's names); see
docs/tensor_parallel.md.
"""

# Each module lists its public names once; the package re-exports them.
from ringlet.parallel.tensor_parallel._prepare import *
from ringlet.parallel.tensor_parallel._prepare import __all__ as _prepare_all
from ringlet.parallel.tensor_parallel.api import *
from ringlet.parallel.tensor_parallel.api import __all__ as _api_all
from ringlet.parallel.tensor_parallel.loss import *
from ringlet.parallel.tensor_parallel.loss import __all__ as _loss_all
from ringlet.parallel.tensor_parallel.style import *
from ringlet.parallel.tensor_parallel.style import __all__ as _style_all

__all__ = [*_style_all, *_prepare_all, *_api_all, *_loss_all]  # noqa: PLE0604
