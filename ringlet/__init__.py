"""ringlet: a distributed training runtime for PyTorch (see README.md and docs/index.md).

The public API mirrors torch's module paths: ``ringlet.distributed`` for ``torch.distributed``,
``ringlet.nn.parallel`` for ``torch.nn.parallel`` and so on.
"""

import torch as _torch

from ringlet._version import __version__, check_torch

check_torch(_torch.__version__)

__all__ = ["__version__"]
