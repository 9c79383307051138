"""``ringlet.distributed.elastic.multiprocessing.errors``: ``record`` at torch's path
(implemented in ``ringlet.launcher.errors``).
"""

from ringlet.launcher.errors import *
from ringlet.launcher.errors import __all__  # noqa: F401
