"""torch.compile around and inside DDP and fully_shard, on 2 processes: training matches one
uncompiled process (the wrappers' own steps run eagerly, the module is compiled)."""

from __future__ import annotations

import shutil

import _compile_workers as W
import pytest

from ringlet.testing.procs import raise_first, run_world

HOWS = ["ddp(compile(model))", "compile(ddp(model))", "compile(fully_shard(model))"]


@pytest.mark.timeout(150)
def test_compiled_ddp_and_fully_shard_train_like_one_process() -> None:
    # aot_eager: dynamo and AOT autograd as inductor uses them, without a C++ compiler
    for got in raise_first(run_world(2, W.compiled_vs_local, HOWS, "aot_eager", timeout=140,
                                     op_timeout=60)):
        assert set(got) == set(HOWS) and all(d < 1e-6 for d in got.values()), got


INDUCTOR = pytest.param("inductor", marks=pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="inductor needs a C++ compiler"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend", ["eager", "aot_eager", INDUCTOR])
def test_tensor_parallel_compiles_and_trains_like_one_process(backend: str) -> None:
    """The styles' hooks run eagerly; DTensor's collectives are traced as ringlet's custom ops
    (aot_eager: AOT autograd as inductor uses it, forward and backward graphs; inductor: those
    graphs compiled to C++, the collectives called from them; run twice, so that the second
    world's processes take the graphs from torch's compile cache: the groups they name must
    resolve there too)."""
    for _ in range(2 if backend == "inductor" else 1):
        for diff in raise_first(run_world(2, W.tensor_parallel, backend, timeout=230,
                                          op_timeout=120)):
            assert diff < 1e-6, diff
