"""DistributedDataParallel: gradient averaging with bucketed, overlapped all-reduces.

- ``ddp.py``: the :class:`DistributedDataParallel` module (torch's constructor and methods);
- ``_reducer.py``: autograd hooks, async bucket all-reduces, end-of-backward finalization;
- ``_bucket_state.py``: bucket buffers and gradient slots; ``_buckets.py``: pure bucket planning;
- ``_graph.py``: output traversal (unused parameters, start of backward);
- ``_grad_bucket.py``: :class:`GradBucket`, what communication hooks receive;
- ``_checks.py``: cross-rank model verification and coalesced broadcasts;
- ``_join.py``: the Join hook (uneven inputs).

Example::

    from ringlet.nn.parallel import DistributedDataParallel as DDP
    model = DDP(MyModel())
"""

from ringlet.parallel.ddp._grad_bucket import GradBucket
from ringlet.parallel.ddp.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel", "GradBucket"]
