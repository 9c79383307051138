"""torch's module path of the activation checkpointing wrappers
(``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``)."""

from ringlet.parallel.checkpoint_wrapper import *
from ringlet.parallel.checkpoint_wrapper import __all__  # noqa: F401
