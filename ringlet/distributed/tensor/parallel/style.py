"""``ringlet.distributed.tensor.parallel.style``: torch's module of the parallel styles (re-exports
only)."""

from ringlet.parallel.tensor_parallel._prepare import *
from ringlet.parallel.tensor_parallel._prepare import __all__ as _prepare_all
from ringlet.parallel.tensor_parallel.style import *
from ringlet.parallel.tensor_parallel.style import __all__ as _style_all

__all__ = [*_prepare_all, *_style_all]
