"""A fast subset of ``scripts/dtensor_opdb.py``: ops of torch's op database run on DTensors
(Replicate, and Shard on each dim of the input) on 2 rank threads, forward and backward, against
plain tensors.  No case may run and give another value; refusing with a clear error is allowed.
The whole sweep and its last result: docs/conformance.md."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "dtensor_opdb.py"

# One or more ops per rule family, and the ops that once ran and gave wrong values or crashed.
SUBSET = [
    "add", "mul", "div", "abs", "exp", "where", "clamp", "sum", "mean", "amax", "softmax",
    "log_softmax", "matmul", "mm", "bmm", "addmm", "nn.functional.linear",
    "nn.functional.layer_norm", "cat", "stack", "transpose", "t", "reshape", "unsqueeze",
    "index_select", "select", "cumsum", "nn.functional.embedding", "conj", "conj_physical",
    "resolve_conj", "resolve_neg", "real", "imag", "view_as_real", "linalg.pinv", "to_sparse",
    "nn.functional.group_norm", "tensor_split",
]


def _load():
    spec = importlib.util.spec_from_file_location("dtensor_opdb", SCRIPT)
    if spec is None or spec.loader is None:
        raise AssertionError(f"cannot load {SCRIPT}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["dtensor_opdb"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def sweep():
    mod = _load()
    ops = mod.load_ops(SUBSET)
    if len({mod.full_name(o).split(".")[0] for o in ops}) < len({s.split(".")[0] for s in SUBSET}):
        raise AssertionError("an op of SUBSET is missing from torch's op_db")
    results, skipped = mod.sweep(ops)
    return mod, results, skipped


@pytest.mark.timeout(120)
def test_no_op_runs_and_gives_a_different_value(sweep) -> None:
    mod, results, skipped = sweep
    assert not skipped
    wrong = {k: d for k, (s, d) in results.items() if s == mod.WRONG}
    assert not wrong, mod.summary(results, skipped)


@pytest.mark.timeout(120)
def test_the_subset_covers_sharded_complex_and_refused_cases(sweep) -> None:
    mod, results, _ = sweep
    # complex values through conjugate views and a kernel that makes them (pinv: A^H)
    for key in [("conj", "complex64", "S(0)"), ("conj", "complex64", "S(2)"),
                ("linalg.pinv", "complex64", "R"), ("index_select", "float32", "R"),
                ("matmul", "float32", "S(0)"), ("nn.functional.linear", "complex64", "S(1)")]:
        assert results.get(key, (None,))[0] == mod.OK, (key, results.get(key))
    # what a DTensor cannot be is refused, naming the op
    status, detail = results[("to_sparse", "float32", "R")]
    assert status == mod.REFUSED and "aten._to_sparse" in detail, detail
    assert sum(1 for s, _ in results.values() if s == mod.OK) > 100
