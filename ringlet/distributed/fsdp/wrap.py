"""torch's module path of the auto-wrap policies (``torch.distributed.fsdp.wrap``)."""

from ringlet.parallel.wrap_policies import *
from ringlet.parallel.wrap_policies import __all__  # noqa: F401
