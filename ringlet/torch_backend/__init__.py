"""ringlet offered as a backend of torch.distributed: ``init_process_group("ringlet")``.

``import ringlet`` registers the backend; torch's own DDP, FSDP2, DTensor, checkpoint and every
library that calls ``torch.distributed`` then run their collectives on ringlet's transports.
Guide: docs/torch_backend.md.

Example::

    import ringlet, torch.distributed as dist
    dist.init_process_group("ringlet")          # under torchrun or ringlet-run
    t = torch.ones(4); dist.all_reduce(t)
"""

from ringlet.torch_backend._register import create, register

__all__ = ["create", "register"]
