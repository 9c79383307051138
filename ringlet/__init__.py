"""ringlet: a distributed training runtime for PyTorch (see README.md and docs/index.md).

The public API mirrors torch's module paths: ``ringlet.distributed`` for ``torch.distributed``,
``ringlet.nn.parallel`` for ``torch.nn.parallel`` and so on.
"""

import torch as _torch

from ringlet._version import __version__, check_torch

check_torch(_torch.__version__)

from ringlet.torch_backend import register as _register_torch_backend

_register_torch_backend()   # init_process_group("ringlet"): docs/torch_backend.md

__all__ = ["__version__"]
