"""``ringlet.distributed.tensor._random``: torch's private ``manual_seed(seed, mesh)`` and
``is_rng_supported_mesh`` (re-exports only; the implementation is ``ringlet.dtensor.random``)."""

from ringlet.dtensor.random import *
from ringlet.dtensor.random import __all__  # noqa: F401
