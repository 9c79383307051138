"""``ringlet.distributed._tensor``: the legacy path of ``ringlet.distributed.tensor`` (re-exports
only).

Published examples still import from here (``from torch.distributed._tensor import DTensor,
Shard, Replicate, distribute_tensor``), so it keeps torch's legacy names (those of
``ringlet.distributed.tensor``, ``DeviceMesh`` and the factories included) and submodules
(``api``, ``placement_types``, ``device_mesh``, ``experimental``).
"""

from ringlet.distributed.tensor import *
from ringlet.distributed.tensor import __all__  # noqa: F401
