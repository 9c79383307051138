"""Calls that used to fail with an unclear error or silently wrong bytes (issue 27, "Store,
launcher, collectives"): point-to-point fingerprints the dtype, DTensor's custom ops check their
arguments, unsigned dtypes reduce, AVG of integers is refused, a garbage abort record in shared
memory is reported as such."""

from __future__ import annotations

import threading

import _clear_error_workers as W
import pytest
import torch

import ringlet.distributed as dist
import ringlet.dtensor._traceable  # noqa: F401 - registers torch.ops.ringlet.*
from ringlet.errors import GroupAbortedError
from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport.arena import H_ABORT


def _expected_unsigned() -> dict[str, list[int]]:
    out = {}
    for dtype, top in W.TOP.items():
        mod = top + 1
        out[f"{dtype}/SUM"] = [(top + 1) % mod, 3, (top + 3) % mod]
        out[f"{dtype}/PRODUCT"] = [top, 2, (3 * top) % mod]
        out[f"{dtype}/MIN"] = [1, 1, 3]
        out[f"{dtype}/MAX"] = [top, 2, top]
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_unsigned_reductions_and_p2p_dtype_mismatch_across_processes(backend: str) -> None:
    """Unsigned SUM/PRODUCT/MIN/MAX are exact; then float32[2] received as float64[1] is
    refused on the receiver and, through the abort, on the sender."""
    reds = raise_first(run_world(2, W.unsigned_reductions, backend=backend, timeout=90))
    assert reds[0] == reds[1] == _expected_unsigned()
    sender, receiver = raise_first(run_world(2, W.p2p_dtype_mismatch, backend=backend,
                                             timeout=90, op_timeout=10))
    assert receiver[0] == ("ok", str([float(x) for x in range(6)]))   # shapes may differ
    kind, text = receiver[1]
    assert kind == "CollectiveMismatchError", text
    assert ("rank 0 sent float32 data of 2 elements (8 bytes) with tag 0, but rank 1 expected "
            "float64 of shape [1] (8 bytes)") in text
    assert sender[0] == ("ok", "")               # the send itself completed: the bytes left
    kind, text = sender[1]
    assert kind == "CollectiveMismatchError" and "rank 0 sent float32 data" in text, text


def _custom_op_refusals(rank: int, n: int) -> dict[str, str]:
    name = dist.group.WORLD.group_name
    calls = {
        "bogus": lambda: torch.ops.ringlet.all_reduce(torch.ones(2), "bogus", name),
        "world0": lambda: torch.ops.ringlet.reduce_scatter(torch.ones(2), "sum", 0, name),
        "world-1": lambda: torch.ops.ringlet.all_gather(torch.ones(2), -1, name),
        "0-d": lambda: torch.ops.ringlet.all_gather(torch.tensor(1.0), n, name),
        "indivisible": lambda: torch.ops.ringlet.reduce_scatter(torch.ones(3), "sum", n, name),
        "world3": lambda: torch.ops.ringlet.all_gather(torch.ones(2), 3, name),
        "avg_int": lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64),
                                           op=dist.ReduceOp.AVG),
        "avg_bool": lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool),
                                            op=dist.ReduceOp.AVG),
    }
    seen = {}
    for key, call in calls.items():
        try:
            call()
            seen[key] = "no error"
        except Exception as e:  # compared below
            seen[key] = f"{type(e).__name__}: {e}"
    gathered = torch.ops.ringlet.all_gather(torch.full((1,), float(rank)), n, name)
    seen["gathered"] = str(gathered.tolist())          # the group is still usable
    return seen


@pytest.mark.timeout(60)
def test_custom_ops_and_avg_of_integers_refuse_clearly() -> None:
    seen = run_threads(_custom_op_refusals, 2)[0]
    assert seen["bogus"] == ("ValueError: torch.ops.ringlet.all_reduce: expected op one of "
                             "['avg', 'max', 'min', 'product', 'sum'], got 'bogus'")
    assert "reduce_scatter: expected world (the group's size) >= 1, got 0" in seen["world0"]
    assert "all_gather: expected world (the group's size) >= 1, got -1" in seen["world-1"]
    assert "expected a tensor with at least one dimension" in seen["0-d"]
    assert "expected dim 0 divisible by world 2, got shape [3]" in seen["indivisible"]
    assert "expected world 2 (the size of group" in seen["world3"]
    for key in ("avg_int", "avg_bool"):
        assert seen[key].startswith("TypeError: [rank 0] all_reduce: op: ReduceOp.AVG expects a "
                                    "floating-point or complex tensor"), seen[key]
    assert seen["gathered"] == "[0.0, 1.0]"


def _garbage_abort_record(rank: int, n: int, done: threading.Event) -> str:
    arena = dist.group.WORLD.transport.arena
    if rank == 1:      # scribbles where the abort record lives, then stays out of the collective
        dist.barrier()
        arena.q[H_ABORT] = 1658426978774945602
        arena.ring()
        if not done.wait(30):
            raise AssertionError("rank 0 never saw the record")
        return "wrote"
    try:               # the barrier may already see the record, or the all_reduce will
        dist.barrier()
        dist.all_reduce(torch.ones(2))
    except GroupAbortedError as e:
        return str(e)
    finally:
        done.set()
    return "no error"


@pytest.mark.timeout(60)
def test_overwritten_abort_record_is_not_reported_as_a_rank() -> None:
    text = run_threads(_garbage_abort_record, 2, threading.Event())[0]
    assert "shared memory was overwritten: its abort record names rank 1658426978774945601, " \
           "not a rank of this group of 2" in text, text
    assert "aborted by rank 1658426978774945601" not in text
