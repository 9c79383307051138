"""ringlet's fully_shard against torch's (FSDP2 on gloo, the oracle), in real processes over shm."""

from __future__ import annotations

import _fsdp_workers
import pytest

from ringlet.testing.procs import raise_first, run_world

pytestmark = pytest.mark.timeout(150)

# bf16: both libraries cast the same fp32 shards to bf16 and reduce in fp32; what differs is
# the order of fp32 summation, which bf16 compute then amplifies -- hence a looser bound.
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-3}


def test_ten_steps_match_torch_fully_shard_in_fp32_and_bf16(tmp_gloo: str) -> None:
    per_rank = raise_first(run_world(2, _fsdp_workers.torch_oracle, tmp_gloo, timeout=140))
    for cases in per_rank:
        assert sorted(cases) == ["mlp/bf16", "mlp/fp32", "transformer/bf16", "transformer/fp32"]
        for case, (ours, theirs, diff) in cases.items():
            tol = TOLERANCE[case.split("/")[1]]
            assert ours == pytest.approx(theirs, abs=tol), case
            assert diff < tol, (case, diff)
