"""``ringlet.distributed.checkpoint``: torch's ``torch.distributed.checkpoint`` (re-exports only).

The implementation lives in ``ringlet.checkpoint`` (layer 8); the format is in docs/checkpoint.md.
``python -m ringlet.distributed.checkpoint`` lists, verifies and converts checkpoints.
"""

from ringlet.checkpoint import *
from ringlet.checkpoint import __all__  # noqa: F401
