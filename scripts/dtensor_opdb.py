"""Differential op test of ringlet's DTensor against plain tensors, driven by torch's op database.

torch ships ``torch.testing._internal.common_methods_invocations.op_db``: every operator with
sample inputs, the dtypes it supports and whether it has gradients.  For each op, dtype
(float32, complex64) and sample, this runs the op on plain tensors and on DTensors over a
1-d mesh of 2 rank threads (ringlet's in-process transport), in several layouts of the
sample's tensors:

* ``R``: every tensor ``Replicate``;
* ``S(d)``: the sample's main input ``Shard(d)`` (for each dim of size >= 2), the others
  ``Replicate``.

The DTensor outputs are gathered (``full_tensor``) and compared with the plain outputs; where
the op and dtype support gradients, a fixed random projection of the outputs is differentiated
and every input's gradient compared too.  Each (op, dtype, layout) is classified over its
samples by the worst outcome:

* ``ok``: ran, values and gradients equal;
* ``refused``: raised a clear error (``NotImplementedError``/``ValueError``/``RuntimeError``
  naming the op, e.g. "no DTensor sharding rule");
* ``wrong``: ran and gave another value or gradient, or failed in some other way (``crash``).

Usage: ``python scripts/dtensor_opdb.py [--ops add,mul,sum] [--time-limit S] [--json FILE]``
(every op by default: about two minutes).  One torch thread.  Prints a summary (counts, refused
ops, wrong cases with their first error); exits 1 when a case is wrong.  The last full run is
in docs/conformance.md; tests/test_dtensor_opdb.py runs a fast subset in CI.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

DTYPES = {"float32": torch.float32, "complex64": torch.complex64}
SAMPLES = 3                 # per (op, dtype): the first few samples
MAX_NUMEL = 4096            # larger samples are skipped (time)
RANKS = 2
OK, REFUSED, WRONG = "ok", "refused", "wrong"
# ops whose tensor arguments besides the input torch reads on the host before any dispatch (a
# DTensor there fails inside torch, for torch's DTensor alike): passed as plain tensors
HOST_ARGS = {"tensor_split"}
_RANK = {OK: 0, REFUSED: 1, WRONG: 2}
_CLEAR = (NotImplementedError, ValueError, RuntimeError, TypeError)


def load_ops(names: Iterable[str] | None = None) -> list[Any]:
    """op_db entries (all, or those whose ``name`` or ``name.variant`` is in ``names``)."""
    from torch.testing._internal.common_methods_invocations import op_db

    if names is None:
        return list(op_db)
    want = set(names)
    return [op for op in op_db if op.name in want or full_name(op) in want]


def full_name(op: Any) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def samples(op: Any, dtype: torch.dtype, limit: int = SAMPLES) -> list[Any]:
    """The op's first ``limit`` samples of ``dtype`` that hold a tensor and are not too big;
    made in the calling thread (rank threads share torch's random generator)."""
    if dtype not in op.supported_dtypes("cpu") or op.is_factory_function:
        return []
    out = []
    torch.manual_seed(0)
    try:
        for s in op.sample_inputs("cpu", dtype, requires_grad=False):
            leaves = [x for x in _tensors((s.input, s.args, s.kwargs))]
            if leaves and all(x.numel() <= MAX_NUMEL and x.layout == torch.strided
                              for x in leaves):
                out.append(s)
            if len(out) >= limit:
                break
    except Exception:  # noqa: BLE001 - an op whose sample generator fails here has no samples
        return out
    return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def layouts(sample: Any) -> list[str]:
    """``R`` and ``S(d)`` for each dim of size >= 2 of the sample's main input."""
    x = sample.input
    out = ["R"]
    if isinstance(x, torch.Tensor):
        out += [f"S({d})" for d in range(x.dim()) if x.shape[d] >= 2]
    return out


def _call(op: Any, sample: Any, convert: Any) -> Any:
    inp, args, kwargs = pytree.tree_map(convert, (sample.input, sample.args, sample.kwargs))
    return op.op(inp, *args, **kwargs)


def _plain_run(op: Any, sample: Any, grad: bool) -> tuple[Any, list[torch.Tensor]]:
    leaves: list[torch.Tensor] = []

    def conv(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        t = x.detach().clone()
        if grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_()
        leaves.append(t)
        return t
    return _call(op, sample, conv), leaves


def _projection(out: Any, seed: int) -> list[torch.Tensor | None]:
    """A fixed random weight per differentiable output leaf (None for the others)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(x.shape, dtype=x.dtype, generator=g)
            if isinstance(x, torch.Tensor) and x.requires_grad else None
            for x in pytree.tree_leaves(out)]


def _loss(out: Any, weights: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    terms = []
    for x, w in zip(pytree.tree_leaves(out), weights):
        if w is None or not isinstance(x, torch.Tensor):
            continue
        x = _full(x)
        if not x.requires_grad:
            continue
        p = (x * w).sum()
        terms.append(p.real if p.is_complex() else p)
    return torch.stack(terms).sum() if terms else None


def _full(x: Any) -> Any:
    from ringlet.distributed.tensor import DTensor

    return x.full_tensor() if isinstance(x, DTensor) else x


def _grads(loss: torch.Tensor | None, leaves: list[torch.Tensor]) -> list[Any]:
    wanted = [t for t in leaves if t.requires_grad]
    if loss is None or not wanted:
        return []
    gs = torch.autograd.grad(loss, wanted, allow_unused=True)
    return [None if g is None else _full(g).detach() for g in gs]


class _SeededOps(TorchDispatchMode):
    """Notes whether an op that draws random numbers ran (aten's ``nondeterministic_seeded``)."""

    drew = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.drew = True
        return func(*args, **(kwargs or {}))


class Case:
    """One (dtype, sample) of an op with its plain-tensor answer, made in the main thread."""

    def __init__(self, op: Any, dtype: str, index: int, sample: Any) -> None:
        self.dtype, self.index, self.sample = dtype, index, sample
        grad = op.supports_autograd and DTYPES[dtype] in op.supported_backward_dtypes("cpu")
        self.grad = grad
        seen = _SeededOps()
        # a run of its own (a mode changes what kernels see); only whether a seeded op ran
        # matters, an error there is the plain run's to report
        with contextlib.suppress(Exception), seen:
            _plain_run(op, sample, False)
        drew = seen.drew
        torch.manual_seed(0)
        out, leaves = _plain_run(op, sample, grad)
        again, _ = _plain_run(op, sample, False)
        # random ops (a DTensor's shards draw independently: docs/dtensor.md) and uninitialized
        # memory: not compared
        self.random = (drew or getattr(op, "has_nondeterministic_output", False)
                       or not _same(_detach(out), _detach(again)))
        self.want = _detach(out)
        self.weights = _projection(out, 1234 + index) if grad else []
        self.want_grads = _grads(_loss(out, self.weights), leaves) if grad else []


def _detach(tree: Any) -> Any:
    return pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def _same(got: Any, want: Any) -> bool:
    try:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True,
                                   check_device=False)
    except (AssertionError, TypeError, ValueError, RuntimeError):
        return False
    return True


def _dtensor_run(op: Any, case: Case, layout: str, mesh: Any) -> tuple[str, str]:
    from ringlet.distributed.tensor import Replicate, Shard, distribute_tensor

    main = case.sample.input
    leaves: list[torch.Tensor] = []

    def conv(x: Any) -> Any:
        if not isinstance(x, torch.Tensor) or (x is not main and op.name in HOST_ARGS):
            return x
        pl = Shard(int(layout[2:-1])) if layout != "R" and x is main else Replicate()
        t = distribute_tensor(x.detach(), mesh, [pl], src_data_rank=None)
        if case.grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_()
        leaves.append(t)
        return t
    try:
        out = _call(op, case.sample, conv)
        got = pytree.tree_map(lambda x: _full(x).detach() if isinstance(x, torch.Tensor) else x,
                              out)
    except _CLEAR as e:
        return (REFUSED, _first_line(e)) if _names_op(e) else (WRONG, "crash: " + _first_line(e))
    except Exception as e:  # noqa: BLE001 - any other failure of a case is a finding
        return WRONG, "crash: " + _first_line(e)
    if not _same(got, case.want):
        return WRONG, "value differs"
    if not case.grad:
        return OK, ""
    try:
        grads = _grads(_loss(out, case.weights), leaves)
    except _CLEAR as e:
        if _names_op(e):
            return REFUSED, "backward: " + _first_line(e)
        return WRONG, "backward crash: " + _first_line(e)
    except Exception as e:  # noqa: BLE001
        return WRONG, "backward crash: " + _first_line(e)
    if not _same(grads, case.want_grads):
        return WRONG, "gradient differs"
    return OK, ""


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def _names_op(e: BaseException) -> bool:
    """A clear refusal names the aten op (or the DTensor call) it refuses."""
    return bool(re.search(r"aten\.|DTensor|placement|Shard|Replicate|Partial", str(e)))


def rank_body(rank: int, n: int, op: Any, cases: list[Case]) -> list[tuple[str, str, int, str,
                                                                         str]]:
    """Every (case, layout) of one op on this rank: (dtype, layout, sample, status, detail)."""
    import warnings

    from ringlet.distributed.device_mesh import init_device_mesh

    warnings.simplefilter("ignore")
    mesh = init_device_mesh("cpu", (n,))
    out = []
    for case in cases:
        for layout in layouts(case.sample):
            status, detail = _dtensor_run(op, case, layout, mesh)
            out.append((case.dtype, layout, case.index, status, detail))
    return out


Result = dict[tuple[str, str, str], tuple[str, str]]   # (op, dtype, layout) -> (status, detail)


def _case(op: Any, dtype: str, index: int, sample: Any) -> Case | None:
    try:
        return Case(op, dtype, index, sample)
    except Exception:  # noqa: BLE001 - the sample is skipped: torch's own op fails on it
        return None


def sweep_op(op: Any, dtypes: Sequence[str] = tuple(DTYPES), limit: int = SAMPLES,
             timeout: float = 120.0, random: set[str] | None = None) -> Result:
    """Every case of one op on a fresh world of 2 rank threads, worst outcome per layout; the
    name of an op whose samples draw random numbers goes into ``random`` (not compared)."""
    from ringlet.testing import RankFailure, run_threads

    cases: list[Case] = []
    for dt in dtypes:
        for i, s in enumerate(samples(op, DTYPES[dt], limit)):
            case = _case(op, dt, i, s)
            if case is None:            # the plain op fails on its own sample: skipped
                continue
            if not case.random:
                cases.append(case)
            elif random is not None:
                random.add(full_name(op))
    if not cases:
        return {}
    name = full_name(op)
    try:
        per_rank = run_threads(rank_body, RANKS, op, cases, timeout=timeout, op_timeout=10.0)
    except RankFailure as e:
        first = str(e).splitlines()[0][:200]
        return {(name, c.dtype, lay): (WRONG, "rank failure: " + first)
                for c in cases for lay in layouts(c.sample)}
    out: Result = {}
    for row0, row1 in zip(*per_rank):
        dt, lay, _, status, detail = row0
        if (row1[3], row1[4]) != (status, detail) and status != WRONG:
            status, detail = WRONG, f"ranks disagree: {row0[3:]} vs {row1[3:]}"
        key = (name, dt, lay)
        if key not in out or _RANK[status] > _RANK[out[key][0]]:
            out[key] = (status, detail)
    return out


def sweep(ops: Sequence[Any], time_limit: float | None = None, progress: bool = False,
          random: set[str] | None = None) -> tuple[Result, list[str]]:
    """Every op in ``ops`` (until ``time_limit`` seconds); returns results and the ops not run
    (random ops' names go into ``random``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _sweep(ops, time_limit, progress, random)
    finally:
        torch.set_num_threads(threads)


def _sweep(ops: Sequence[Any], time_limit: float | None, progress: bool,
           random: set[str] | None) -> tuple[Result, list[str]]:
    start = time.monotonic()
    results: Result = {}
    skipped: list[str] = []
    for k, op in enumerate(ops):
        if time_limit is not None and time.monotonic() - start > time_limit:
            skipped = [full_name(o) for o in ops[k:]]
            break
        res = sweep_op(op, random=random)
        results.update(res)
        if progress:
            bad = sum(1 for s, _ in res.values() if s == WRONG)
            print(f"[{k + 1}/{len(ops)} {time.monotonic() - start:6.0f}s] {full_name(op)}: "
                  f"{len(res)} cases{f', {bad} WRONG' if bad else ''}", file=sys.stderr,
                  flush=True)
    return results, skipped


def _refusal_kind(detail: str) -> str:
    m = re.search(r"(aten\.[\w.]+)", detail)
    if "no DTensor sharding rule" in detail:
        return f"no sharding rule: {m.group(1) if m else '?'}"
    if "expected DTensor arguments only" in detail:
        return "plain tensor created inside the op"
    return detail.split(":", 2)[-1].strip()[:80]


def summary(results: Result, skipped: Sequence[str], random: Iterable[str] = ()) -> str:
    """Counts per status (cases and ops), the refusals grouped, every wrong case."""
    counts = collections.Counter(s for s, _ in results.values())
    by_op: dict[str, set[str]] = collections.defaultdict(set)
    for (name, _, _), (s, _) in results.items():
        by_op[name].add(s)
    op_counts = collections.Counter(
        WRONG if WRONG in v else REFUSED if REFUSED in v else OK for v in by_op.values())
    lines = [f"cases (op, dtype, layout): {len(results)}: "
             + ", ".join(f"{counts[k]} {k}" for k in (OK, REFUSED, WRONG)),
             (f"ops: {len(by_op)}: {op_counts[OK]} all ok, {op_counts[REFUSED]} partly refused, "
              f"{op_counts[WRONG]} with a wrong case")]
    if skipped:
        lines.append(f"not reached (time limit): {len(skipped)} ops")
    random = sorted(random)
    if random:
        lines.append(f"not compared (random draws): {len(random)} ops: {', '.join(random)}")
    kinds = collections.Counter(_refusal_kind(d) for s, d in results.values() if s == REFUSED)
    lines.append("refusals by reason (cases):")
    lines += [f"  {n:5d}  {k}" for k, n in kinds.most_common(40)]
    wrong = sorted((k, d) for k, (s, d) in results.items() if s == WRONG)
    lines.append(f"wrong cases: {len(wrong)}")
    lines += [f"  {'/'.join(k)}: {d}" for k, d in wrong]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", help="comma-separated op_db names (default: every op)")
    p.add_argument("--time-limit", type=float, default=None, help="stop starting ops after S s")
    p.add_argument("--json", metavar="FILE", help="also write every case's result as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    a = p.parse_args(argv)
    ops = load_ops(a.ops.split(",") if a.ops else None)
    random: set[str] = set()
    results, skipped = sweep(ops, a.time_limit, progress=not a.quiet, random=random)
    print(summary(results, skipped, random))
    if a.json:
        with open(a.json, "w") as f:
            json.dump([list(k) + list(v) for k, v in sorted(results.items())], f, indent=0)
    return 1 if any(s == WRONG for s, _ in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
