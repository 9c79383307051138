"""``ringlet.distributed.nn.functional``: torch's ``torch.distributed.nn.functional``,
collectives that autograd differentiates (re-exports ``ringlet.c10d.nn_functional``, torch's
private ``_all_gather_base`` included)."""

from ringlet.c10d.nn_functional import *
from ringlet.c10d.nn_functional import __all__  # noqa: F401
