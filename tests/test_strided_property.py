"""Property test (docs/reliability.md, row C8): any strided view, any collective: the result lands
in the user's view, equal to the same collective on contiguous copies, and nothing outside the view
changes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ringlet.distributed as dist
from ringlet.testing import run_threads


@st.composite
def views(draw):
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["T", "cols", "block", "rows"]))
    return rows, cols, kind


def _view(t: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "T":
        return t.T
    if kind == "cols":
        return t[:, ::2]
    if kind == "block":
        return t[t.shape[0] // 2:, : max(1, t.shape[1] // 2)]
    return t[::2]


def _body(rank: int, n: int, rows: int, cols: int, kind: str, op: str) -> bool:
    base = (torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 3 * rank) % 7
    buf = base.clone()
    v = _view(buf, kind)
    untouched = torch.ones_like(buf, dtype=torch.bool)
    _view(untouched, kind).fill_(False)
    before = buf[untouched].clone()
    allv = [_view((torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols) + 3 * r) % 7,
                  kind)
            for r in range(n)]
    if op == "all_reduce":
        dist.all_reduce(v)
        want = sum(allv)
    elif op == "broadcast":
        dist.broadcast(v, src=n - 1)
        want = allv[n - 1]
    else:
        outbig = torch.zeros(n * v.numel() * 2)[::2]
        dist.all_gather_into_tensor(outbig, v)
        return torch.equal(outbig, torch.cat([a.reshape(-1) for a in allv]))
    return torch.equal(v, want) and torch.equal(buf[untouched], before)


@pytest.mark.timeout(120)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(views(), st.sampled_from(["all_reduce", "broadcast", "all_gather_into_tensor"]))
def test_strided_views_get_correct_results(spec, op) -> None:
    rows, cols, kind = spec
    assert all(run_threads(_body, 2, rows, cols, kind, op))
