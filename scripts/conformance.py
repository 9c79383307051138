"""Run torch's own distributed test suite against ringlet (or against torch, as the reference).

PyTorch ships the body of its distributed tests in the wheel
(``torch/testing/_internal/distributed/distributed_test.py``, class
``DistributedTest._DistTestBase``).  This runner loads that file from the installed torch, with
``--impl ringlet`` rewrites its public module paths to ringlet's (the same text substitution a user
makes to migrate a script, see ``SUBSTITUTIONS``), and runs the CPU subset -- collectives,
point-to-point, groups, barriers, object collectives, DDP, SyncBatchNorm, Join, comm hooks, the
sampler -- with ``BACKEND=gloo``, one test at a time: every rank is a forked process, every test
has a deadline, every process is reaped.  ``--impl torch`` runs the same subset on torch itself.

Usage::

    python scripts/conformance.py --impl ringlet              # the whole subset, world size 2
    python scripts/conformance.py --impl torch --world-size 3
    python scripts/conformance.py --impl ringlet -k all_reduce -k barrier
    python scripts/conformance.py --impl ringlet --ci         # the short list CI runs
    python scripts/conformance.py --impl torch-backend        # torch's stack on backend "ringlet"
    python scripts/conformance.py --list                      # the selected tests, no run

Prints one line per test and ``N passed, N failed, N skipped``; exits 1 when a test failed.
The recorded runs and the tests ringlet does not pass are in docs/conformance.md.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import types
from datetime import timedelta
from typing import Any

SUITE = "torch/testing/_internal/distributed/distributed_test.py"

# -- what the substitution maps ------------------------------------------------------------------
# Module paths a migrating user rewrites (torch's -> ringlet's).  Imports from these modules move.
MODULE_MAP = {
    "torch.distributed": "ringlet.distributed",
    "torch.distributed.distributed_c10d": "ringlet.distributed.distributed_c10d",
    "torch.distributed.device_mesh": "ringlet.distributed.device_mesh",
    "torch.distributed.algorithms.ddp_comm_hooks": "ringlet.distributed.algorithms.ddp_comm_hooks",
    "torch.distributed.algorithms.join": "ringlet.distributed.algorithms.join",
    "torch.nn.parallel": "ringlet.nn.parallel",
    "torch.utils.data.distributed": "ringlet.utils.data.distributed",
}
# Names the suite imports from a mapped module that ringlet does not provide: they stay torch's,
# and the tests that use them are outside the subset (see EXCLUDE).
TORCH_ONLY_NAMES = {
    "torch.distributed.algorithms.ddp_comm_hooks": {
        "post_localSGD_hook": "post-local SGD (model averaging) is not part of ringlet",
        "quantization": "quantization comm hooks are not part of ringlet",
    },
}
# Whole modules the suite imports that ringlet does not mirror: kept as torch's.
TORCH_ONLY_MODULES = {
    "torch.distributed.algorithms.model_averaging.averagers": "model averaging: not in ringlet",
    "torch.distributed.algorithms.model_averaging.hierarchical_model_averager": "not in ringlet",
    "torch.distributed.algorithms.model_averaging.utils": "model averaging: not in ringlet",
    "torch.distributed.optim.post_localSGD_optimizer": "post-local SGD: not in ringlet",
    "torch.distributed.optim": "_apply_optimizer_in_backward: torch's private optimizer overlap",
    "torch.distributed.utils": "torch's private DDP helpers (_sync_module_states, ...)",
    "torch.nn.parallel.distributed": "private constants of torch's DDP (bucket sizes, env dump)",
}
# Dotted names in code (not imports), rewritten after the imports.
CODE_SUBSTITUTIONS = [
    (r"(?<![\w.])(?:torch\.)?nn\.parallel\.DistributedDataParallel\b",
     "ringlet.nn.parallel.DistributedDataParallel"),
    (r"(?<![\w.])torch\.distributed\.(new_group|init_process_group|destroy_process_group)\b",
     r"ringlet.distributed.\1"),
    (r"(?<![\w.])(?:torch\.)?nn\.SyncBatchNorm\b", "ringlet.nn.SyncBatchNorm"),
]
# Appended (not prepended: line numbers stay torch's); bodies reach ringlet.nn... at call time.
RINGLET_HEADER = "\nimport ringlet.distributed\nimport ringlet.nn\nimport ringlet.nn.parallel\n"

# -- which tests ---------------------------------------------------------------------------------
# The CPU subset: tests of these areas (regular expressions on the test name).
INCLUDE = [
    r"^test_(get_rank|get_backend|Backend_enum_class|destroy_|get_rank_size_|new_subgroups)",
    r"^test_(barrier|monitored_barrier)",
    r"^test_(send_recv|isend|irecv|batch_isend_irecv)",
    r"^test_(broadcast|reduce|all_reduce|sparse_all_reduce|scatter|gather|all_gather|all_to_all)",
    r"_object",
    r"^test_(DistributedDataParallel|ddp_|accumulate_gradients|get_future|grads_same_across_ranks)",
    r"^test_(invalid_static_graph|static_graph|output_unused|undefined_grad|different_graph)",
    r"^test_(detect_ddp|verify_model|skip_all_reduce|stateless_api|compute_bucket_assignment)",
    r"SyncBatchNorm|^test_sync_bn",
    r"^test_DistributedSampler",
]
# Outside the CPU subset: GPU/NCCL, profiler traces, and torch features ringlet does not have.
EXCLUDE = [
    r"cuda|nccl|gpu|_half$|non_default_stream",
    r"profil|execution_trace",
    r"averag|post_localSGD|hierarchical",
    r"mixed_precision|with_amp|apply_optim_in_backward|hook_with_optimizer_parity",
    r"compile|device_mesh|has_finalized",
]
# What CI runs (tests/test_conformance.py): every test that passes on torch and on ringlet here,
# less the ones that measure wall-clock time (barrier timeouts), which a loaded machine can fail.
# (test names without their "test_" prefix, wrapped)
_CI_NAMES = """
Backend_enum_class DistributedDataParallel_requires_grad accumulate_gradients_no_sync
accumulate_gradients_no_sync_grad_is_view all_gather all_gather_coalesced_complex
all_gather_coalesced_full_group all_gather_coalesced_simple all_gather_coalesced_with_empty
all_gather_complex all_gather_full_group all_gather_object_default_pg
all_gather_object_subgroup all_reduce_coalesced_full_group_max
all_reduce_coalesced_full_group_min all_reduce_coalesced_full_group_product
all_reduce_coalesced_full_group_sum all_reduce_coalesced_max
all_reduce_coalesced_max_complex_unsupported all_reduce_coalesced_min
all_reduce_coalesced_product all_reduce_coalesced_sum all_reduce_complex_unsupported_ops
all_reduce_full_group_max all_reduce_full_group_min all_reduce_full_group_product
all_reduce_full_group_sum all_reduce_max all_reduce_min all_reduce_product all_reduce_sum
all_reduce_sum_async all_reduce_sum_complex all_to_all_single_equal_split
all_to_all_single_equal_split_complex all_to_all_single_equal_split_full_group
all_to_all_single_unequal_split all_to_all_single_unequal_split_complex
all_to_all_single_unequal_split_full_group batch_isend_irecv_gloo
batch_isend_irecv_gloo_tags batch_isend_irecv_op_list_err broadcast broadcast_full_group
ddp_create_graph destroy_full_group destroy_group gather gather_checks gather_full_group
gather_object gather_object_subgroup get_backend get_future get_rank
get_rank_size_full_group get_rank_size_group grads_same_across_ranks_with_no_sync irecv
isend monitored_barrier_gloo_rank_0_timeout monitored_barrier_gloo_subgroup
reduce_full_group_max reduce_full_group_min reduce_full_group_product reduce_full_group_sum
reduce_max reduce_min reduce_product reduce_sum reduce_sum_twice scatter scatter_checks
scatter_complex scatter_full_group scatter_object_list send_recv send_recv_any_source
send_recv_with_tag sparse_all_reduce_sum
"""
CI_TESTS = ["test_" + n for n in _CI_NAMES.split()]

SKIP_CODES: dict[int, str] = {}      # exit code -> reason, from torch's TEST_SKIPS
TEST_ERROR_EXIT = 10


@dataclasses.dataclass
class Result:
    name: str
    status: str          # pass | fail | skip | timeout
    seconds: float
    detail: str = ""


# -- loading the suite ---------------------------------------------------------------------------
def suite_path() -> str:
    import torch

    return os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), SUITE)


def _import_text(node: ast.ImportFrom, module: str, names: list[ast.alias], indent: str) -> str:
    parts = [f"{a.name} as {a.asname}" if a.asname else a.name for a in names]
    return f"{indent}from {module} import {', '.join(parts)}\n"


def _rewrite_import(node: ast.stmt, indent: str) -> str | None:
    """The ringlet text for one import statement, or None to keep it."""
    if isinstance(node, ast.Import):
        out = []
        for a in node.names:
            target = MODULE_MAP.get(a.name)
            if target is None:
                return None
            out.append(f"{indent}import {target}" + (f" as {a.asname}" if a.asname else "") + "\n")
        return "".join(out)
    if not isinstance(node, ast.ImportFrom) or node.module not in MODULE_MAP:
        return None
    kept = TORCH_ONLY_NAMES.get(node.module, {})
    ours = [a for a in node.names if a.name not in kept]
    theirs = [a for a in node.names if a.name in kept]
    text = _import_text(node, MODULE_MAP[node.module], ours, indent) if ours else ""
    if theirs:
        text += _import_text(node, node.module, theirs, indent)
    return text


def substitute(source: str) -> str:
    """torch's public module paths -> ringlet's, as a user migrating the file would do it."""
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            line = lines[node.lineno - 1]
            text = _rewrite_import(node, line[:len(line) - len(line.lstrip())])
            if text is not None:
                edits.append((node.lineno - 1, node.end_lineno or node.lineno, text))
    for start, end, text in sorted(edits, reverse=True):
        pad = (end - start) - text.count("\n")      # keep line numbers: tracebacks point right
        lines[start:end] = [text + "\n" * max(0, pad)]
    out = "".join(lines)
    for pattern, repl in CODE_SUBSTITUTIONS:
        out = re.sub(pattern, repl, out)
    return out + RINGLET_HEADER


def load_suite(impl: str) -> types.ModuleType:
    """Import the suite (after ``substitute`` for ringlet) as module ``conformance_suite``."""
    path = suite_path()
    with open(path) as f:
        source = f.read()
    if impl == "torch-backend":      # torch's suite as it is, its groups on backend "ringlet"
        import ringlet  # registers the backend
    if impl == "ringlet":
        source = substitute(source)
        from torch.testing._internal import common_distributed

        import ringlet.distributed

        # The suite's helpers (with_dist_debug_levels, ...) reach torch.distributed through this
        # module attribute; a migrated helper module would name ringlet's.
        common_distributed.c10d = ringlet.distributed
    mod = types.ModuleType("conformance_suite")
    mod.__file__ = path
    sys.modules[mod.__name__] = mod
    exec(compile(source, path, "exec"), mod.__dict__)  # noqa: S102 - torch's own test file
    mod.INIT_BACKEND = "ringlet" if impl == "torch-backend" else mod.BACKEND
    from torch.testing._internal.common_distributed import TEST_SKIPS

    SKIP_CODES.update({s.exit_code: s.message for s in TEST_SKIPS.values()})
    return mod


def case_class(mod: types.ModuleType) -> type:
    """``DistributedTest._DistTestBase`` on torch's TestCase (its assertEqual knows tensors)."""
    from torch.testing._internal.common_utils import FILE_SCHEMA, TestCase

    class Case(mod.DistributedTest._DistTestBase, TestCase):
        rank = -1
        file_name = ""

        @property
        def world_size(self) -> str:
            return os.environ["WORLD_SIZE"]

        @property
        def init_method(self) -> str:
            return f"{FILE_SCHEMA}{self.file_name}"

        @property
        def destroy_pg_upon_exit(self) -> bool:
            return False

    Case.__name__ = Case.__qualname__ = "TestDistBackendWithSpawn"
    return Case


def select(cls: type, patterns: list[str], ci: bool) -> list[str]:
    names = sorted(n for n in dir(cls) if n.startswith("test_"))
    if ci:
        missing = [n for n in CI_TESTS if n not in names]
        if missing:
            raise SystemExit(f"conformance: CI tests not in this torch's suite: {missing}")
        return list(CI_TESTS)
    chosen = [n for n in names if any(re.search(p, n) for p in INCLUDE)
              and not any(re.search(p, n) for p in EXCLUDE)]
    if patterns:
        chosen = [n for n in chosen if any(p == n or re.search(p, n) for p in patterns)]
    return chosen


# -- one rank ------------------------------------------------------------------------------------
def _set_pdeathsig() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: die with the runner
    except OSError:
        pass


def _rank_main(mod: types.ModuleType, cls: type, name: str, rank: int, init_file: str,
               out_dir: str) -> None:
    """What torch's ``TestDistBackend._run`` does for one rank, reporting into ``out_dir``."""
    import faulthandler
    import traceback
    import unittest

    from torch.testing._internal import common_utils

    _set_pdeathsig()
    log = open(os.path.join(out_dir, f"rank{rank}.log"), "w")  # noqa: SIM115 - lives until exit
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ["TORCH_SHOW_CPP_STACKTRACES"] = "1"
    common_utils.set_rng_seed()
    self = cls(name)
    self.rank, self.file_name = rank, init_file
    dist = mod.dist
    seconds = mod.CUSTOM_PG_TIMEOUT.get(name, mod.default_pg_timeout)
    code = 0
    try:
        dist.init_process_group(init_method=self.init_method, backend=mod.INIT_BACKEND,
                                world_size=int(self.world_size), rank=rank,
                                timeout=timedelta(seconds=seconds))
        self._barrier()
        getattr(self, name)()
        self._barrier()
        dist.destroy_process_group()
    except unittest.SkipTest as e:
        code = mod.TEST_SKIPS["generic"].exit_code
        _note(out_dir, rank, f"skipped: {e}")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported to the runner
        code = TEST_ERROR_EXIT
        _note(out_dir, rank, traceback.format_exc())
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _note(out_dir: str, rank: int, text: str) -> None:
    with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
        f.write(text)


# -- one test ------------------------------------------------------------------------------------
def run_one(mod: types.ModuleType, cls: type, name: str, world_size: int, timeout: float,
            run_dir: str) -> Result:
    tmp = tempfile.mkdtemp(prefix=f"{name[:40]}-", dir=run_dir)
    for sub in ("barrier", "test_dir", "init_dir"):
        os.mkdir(os.path.join(tmp, sub))
    os.environ["TEMP_DIR"] = tmp
    shared_init = mod.INIT_METHOD.removeprefix("file://")
    if os.path.exists(shared_init):
        os.remove(shared_init)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank_main,
                         args=(mod, cls, name, r, os.path.join(tmp, "init"), tmp),
                         name=f"rank{r}") for r in range(world_size)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    timed_out = _join(procs, t0 + timeout)
    seconds = time.monotonic() - t0
    result = _judge(name, procs, tmp, seconds, timed_out)
    if result.status == "pass":
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _join(procs: list[Any], deadline: float) -> bool:
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    late = [p for p in procs if p.exitcode is None]
    for p in late:
        os.kill(p.pid, signal.SIGUSR1)      # stacks into the rank's log
    if late:
        time.sleep(1.0)
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join(5.0)
    return bool(late)


def _judge(name: str, procs: list[Any], tmp: str, seconds: float, timed_out: bool) -> Result:
    codes = [p.exitcode for p in procs]
    errors = []
    for r in range(len(procs)):
        path = os.path.join(tmp, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                errors.append((r, f.read()))
    if timed_out:
        return Result(name, "timeout", seconds,
                      f"ranks {codes} after {seconds:.0f} s; logs in {tmp}")
    if TEST_ERROR_EXIT not in codes:
        skips = [SKIP_CODES[c] for c in codes if c in SKIP_CODES]
        if skips:
            reason = next((e for _, e in errors if e.startswith("skipped:")), skips[0])
            return Result(name, "skip", seconds, reason.removeprefix("skipped: ").strip())
    if all(c == 0 for c in codes):
        return Result(name, "pass", seconds)
    first = next(((r, e) for r, e in errors if not e.startswith("skipped:")), None)
    if first is None:
        return Result(name, "fail", seconds, f"exit codes {codes}; logs in {tmp}")
    return Result(name, "fail", seconds, f"rank {first[0]}: {_exception_line(first[1])}")


def _exception_line(tb: str) -> str:
    """The first line of the exception a traceback ends with."""
    lines = tb.strip().splitlines()
    heads = [ln for ln in lines
             if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Failure)\b", ln)]
    return (heads[-1] if heads else lines[-1])[:300]


# -- the run -------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("torch", "ringlet", "torch-backend"), default="ringlet",
                    help="torch: torch's stack; ringlet: the suite migrated to ringlet's API; "
                         "torch-backend: torch's stack with its groups on backend 'ringlet'")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("-k", dest="patterns", action="append", default=[],
                    help="run only tests whose name matches (regular expression; repeatable)")
    ap.add_argument("--ci", action="store_true", help="run the short list that CI runs")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per test (all ranks)")
    ap.add_argument("--list", action="store_true", help="print the selected tests and exit")
    ap.add_argument("--json", help="write the results to this file")
    ap.add_argument("--verbose", action="store_true", help="print each failure's rank log tail")
    args = ap.parse_args(argv)

    run_dir = tempfile.mkdtemp(prefix=f"conformance-{args.impl}-")
    os.environ.update(BACKEND="gloo", WORLD_SIZE=str(args.world_size), TEMP_DIR=run_dir,
                      INIT_METHOD=f"file://{run_dir}/shared_init_file",
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1",
                      PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    mod = load_suite(args.impl)
    cls = case_class(mod)
    names = select(cls, args.patterns, args.ci)
    if args.list:
        print("\n".join(names))
        return 0
    print(f"conformance: {len(names)} tests of {SUITE}, impl {args.impl}, world size "
          f"{args.world_size}",
          flush=True)
    results = []
    for name in names:
        res = run_one(mod, cls, name, args.world_size, args.timeout, run_dir)
        results.append(res)
        detail = f"  {res.detail}" if res.detail else ""
        print(f"{res.status.upper():8s}{name} ({res.seconds:.1f} s){detail}", flush=True)
    return _summary(results, args, run_dir)


def _summary(results: list[Result], args: argparse.Namespace, run_dir: str) -> int:
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "timeout", "skip")}
    failed = counts["fail"] + counts["timeout"]
    print(f"{counts['pass']} passed, {failed} failed, {counts['skip']} skipped "
          f"({sum(r.seconds for r in results):.0f} s; impl {args.impl}, world size "
          f"{args.world_size})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"impl": args.impl, "world_size": args.world_size,
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
    if not failed:
        shutil.rmtree(run_dir, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
