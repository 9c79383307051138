"""A data-loader stand-in for the benchmarks: every step's batch comes from a
``torch.utils.data.DataLoader`` whose worker processes spend CPU time on each batch, as decoding
and augmenting do, so that they compete with the ranks for the cores (``bench/ddp.py
--loader-workers``)."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["batch_source"]


class _Batches(torch.utils.data.Dataset):
    """Batch ``i`` is ``make(seed0 + 1000 * (i + 1))`` (distinct across ranks' ``seed0`` < 1000),
    made after ``work_ms`` of CPU time in the worker that makes it."""

    def __init__(self, make: Callable[[int], Any], seed0: int, work_ms: float) -> None:
        self.make, self.seed0, self.work_s = make, seed0, work_ms / 1e3

    def __len__(self) -> int:
        return 1 << 30

    def __getitem__(self, i: int) -> Any:
        t0 = time.thread_time()
        while time.thread_time() - t0 < self.work_s:   # CPU time, whatever else runs
            pass
        return self.make(self.seed0 + 1000 * (i + 1))


def _one_thread(_worker: int) -> None:
    torch.set_num_threads(1)


def batch_source(make: Callable[[int], Any], seed0: int, workers: int,
                 work_ms: float) -> tuple[Callable[[], Any], Callable[[], None]]:
    """``(next_batch, close)``.  ``workers == 0``: always the batch ``make(seed0)``, made once;
    else the batches of a DataLoader with that many worker processes (``make`` must be picklable
    where workers are spawned).  ``close()`` stops the workers."""
    if workers == 0:
        batch = make(seed0)
        return (lambda: batch), (lambda: None)
    loader = torch.utils.data.DataLoader(_Batches(make, seed0, work_ms), batch_size=None,
                                         num_workers=workers, worker_init_fn=_one_thread)
    # Benchmark ranks are daemonic (they die with the benchmark) and multiprocessing refuses
    # children of a daemon; torch's workers are daemonic themselves and close() stops them.
    config = multiprocessing.current_process()._config   # type: ignore[attr-defined]
    daemon = config.pop("daemon", None)
    try:
        it = iter(loader)
    finally:
        if daemon is not None:
            config["daemon"] = daemon
    return (lambda: next(it)), getattr(it, "_shutdown_workers", lambda: None)
