"""``ringlet.distributed.tensor.parallel._data_parallel_utils``: torch's private DTensor
flatten/unflatten.

Re-exports only; the implementation is ``ringlet.parallel._data_parallel_utils``.

"""

from ringlet.parallel._data_parallel_utils import *
from ringlet.parallel._data_parallel_utils import __all__  # noqa: F401
