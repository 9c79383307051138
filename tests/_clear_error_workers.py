"""Rank bodies of tests/test_clear_errors.py that run in real processes (module level, so that
they pickle by reference)."""

from __future__ import annotations

import torch

import ringlet.distributed as dist

TOP = {torch.uint16: 2**16 - 1, torch.uint32: 2**32 - 1, torch.uint64: 2**64 - 1}


def unsigned(vals: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of unsigned ``dtype`` holding ``vals`` (uint64 built through an int64 view)."""
    if dtype == torch.uint64:
        return torch.tensor([v - 2**64 if v >= 2**63 else v for v in vals]).view(torch.uint64)
    return torch.tensor(vals, dtype=dtype)


def unsigned_reductions(rank: int, n: int) -> dict[str, list[int]]:
    """SUM, PRODUCT, MIN and MAX of unsigned dtypes (no torch add/min/max kernel for them)."""
    out: dict[str, list[int]] = {}
    for dtype, top in TOP.items():
        for op in ("SUM", "PRODUCT", "MIN", "MAX"):
            # rank 0: [top, 1, 3], rank 1: [1, 2, top]: SUM wraps, MIN/MAX compare unsigned
            t = unsigned([top, 1, 3] if rank == 0 else [1, 2, top], dtype)
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
            out[f"{dtype}/{op}"] = t.tolist()
    return out


def p2p_dtype_mismatch(rank: int, n: int) -> list[tuple[str, str]]:
    """A matching pair (shapes may differ), then float32[2] sent and received as float64[1];
    each rank reports what its receive/send and its next collective raised."""
    seen: list[tuple[str, str]] = []
    if rank == 0:
        dist.send(torch.arange(6, dtype=torch.float32).reshape(2, 3), dst=1)
    else:
        flat = torch.zeros(6)
        dist.recv(flat, src=0)
        seen.append(("ok", str(flat.tolist())))
    for step in (lambda: dist.send(torch.ones(2), dst=1) if rank == 0
                 else dist.recv(torch.zeros(1, dtype=torch.float64), src=0),
                 dist.barrier):
        try:
            step()
            seen.append(("ok", ""))
        except Exception as e:  # reported to the test
            seen.append((type(e).__name__, str(e)))
    return seen
