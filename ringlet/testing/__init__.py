"""Try distributed code without processes, and run real multi-process worlds in tests.

- :func:`run_threads` runs ``fn(rank, world_size, *args)`` on ``world_size`` threads,
  each with its own default process group over the ``inproc`` transport (the
  same protocol as ``shm``).  Milliseconds per world.
- :func:`run_world` (``ringlet.testing.procs``) runs it in real processes over ``shm``.

Example::

    from ringlet.testing import run_threads
    import ringlet.distributed as dist

    def body(rank, world_size):
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        return t.item()

    assert run_threads(body, 2) == [3.0, 3.0]
"""

from ringlet.testing.threads import RankFailure, run_threads

__all__ = ["RankFailure", "run_threads"]
