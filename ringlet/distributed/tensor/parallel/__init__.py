"""``ringlet.distributed.tensor.parallel``: torch's ``torch.distributed.tensor.parallel``
(re-exports only).

The implementation lives in ``ringlet.parallel.tensor_parallel`` (layer 7); the submodules
``api``, ``style`` and ``loss`` mirror torch's.
"""

from ringlet.parallel.tensor_parallel import *
from ringlet.parallel.tensor_parallel import __all__  # noqa: F401
