"""ringlet-run: pure planning (flags, environments, validation), then end-to-end launches
of torch-free scripts; every launcher started here is killed with its workers in a finally."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ringlet.launcher import LaunchConfig, parse_args, worker_command, worker_env
from ringlet.launcher._job import failure_summary
from ringlet.launcher._plan import WORKER_FILE, error_file, parse_nproc
from ringlet.launcher._supervisor import WorkerFailure, describe_exit, read_error_file

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- plan (pure)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("spelling", ["dash", "underscore", "equals"])
def test_flag_spellings(spelling: str) -> None:
    flags = ["--nproc-per-node", "3", "--master-addr", "10.0.0.1", "--master-port", "1234",
             "--node-rank", "0", "--max-restarts", "2", "--rdzv-id", "job7"]
    if spelling == "underscore":
        flags = ["--" + f[2:].replace("-", "_") if f.startswith("--") else f for f in flags]
    elif spelling == "equals":
        flags = [f"{k}={v}" for k, v in zip(flags[::2], flags[1::2], strict=True)]
    cfg = parse_args([*flags, "train.py", "--lr", "0.1", "-m"])
    assert cfg == LaunchConfig(
        entrypoint="train.py", args=("--lr", "0.1", "-m"), nproc_per_node=3,
        master_addr="10.0.0.1", master_port=1234, max_restarts=2, rdzv_id="job7",
    )


@pytest.mark.timeout(60)
def test_defaults_modes_and_endpoints() -> None:
    cfg = parse_args(["train.py"])
    assert (cfg.nproc_per_node, cfg.nnodes, cfg.master_addr, cfg.master_port) == (
        1, 1, "127.0.0.1", 0)
    assert (cfg.monitor_interval, cfg.grace_period, cfg.max_restarts) == (0.1, 5.0, 0)
    assert parse_args(["-m", "pkg.train", "x"]).module
    assert parse_args(["--no-python", "echo", "hi"]).no_python
    assert parse_args(["--nnodes", "1:1", "t.py"]).nnodes == 1
    ep = parse_args(["--rdzv-endpoint", "h:77", "t.py"])
    assert (ep.master_addr, ep.master_port) == ("h", 77)
    alone = parse_args(["--standalone", "--master-port", "99", "t.py"])
    assert (alone.standalone, alone.master_addr, alone.master_port) == (True, "127.0.0.1", 0)
    assert parse_args(["--nproc-per-node", "cpu", "t.py"]).nproc_per_node == (os.cpu_count() or 1)
    assert parse_nproc("auto", cpu_count=7) == 7
    timing = parse_args(["--grace-period", "2", "--monitor_interval", "0.5", "t.py"])
    assert (timing.grace_period, timing.monitor_interval) == (2.0, 0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("argv", "message"), [
    (["--nproc-per-node", "0", "t.py"], "expected --nproc-per-node >= 1, got 0"),
    (["--nproc-per-node", "gpu", "t.py"], "expected a positive integer, 'cpu' or 'auto', got 'g"),
    (["--nnodes", "2", "--node-rank", "2", "t.py"], "expected 0 <= --node-rank < --nnodes"),
    (["--nnodes", "1:4", "t.py"], "expected a fixed node count"),
    (["--master-port", "70000", "t.py"], r"expected --master-port in \[0, 65535\], got 70000"),
    (["--max-restarts", "-1", "t.py"], "expected --max-restarts >= 0, got -1"),
    (["--monitor-interval", "0", "t.py"], "expected --monitor-interval > 0, got 0.0"),
    (["--grace-period", "soon", "t.py"], "expected a number of seconds, got 'soon'"),
    (["-m", "--no-python", "t.py"], "expected at most one of -m/--module and --no-python"),
    (["--standalone", "--nnodes", "2", "t.py"], "expected --nnodes 1 with --standalone, got 2"),
    (["--rdzv-endpoint", "h:x", "t.py"], "expected --rdzv-endpoint HOST"),
    (["--tee", "9", "t.py"], r"expected --tee as 0-3 or LOCAL_RANK:0-3 pairs"),
    (["--redirects", "0:x", "t.py"], r"expected --redirects as 0-3"),
    (["--local-ranks-filter", "a", "t.py"], "expected --local-ranks-filter as comma-separated"),
    (["--heartbeat-timeout", "-1", "t.py"], "expected --heartbeat-timeout >= 0, got -1.0"),
    (["--nosuchflag", "t.py"], "unrecognized arguments"),
    ([], "required: training_script"),
])
def test_validation_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_args(argv)


@pytest.mark.timeout(60)
def test_worker_env_is_torchruns_full_set() -> None:
    cfg = LaunchConfig(entrypoint="t.py", nproc_per_node=2, nnodes=3, node_rank=1,
                       master_addr="10.1.2.3", max_restarts=4)
    env = worker_env(cfg, 1, 2, 4321, run_id="rid", run_dir="/d", token_file="/d/tok",
                     launcher_pid=55, base_env={"PATH": "/bin"})
    assert env == {
        "PATH": "/bin", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "6",
        "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "3", "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "6", "ROLE_NAME": "default", "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "4321", "TORCHELASTIC_RUN_ID": "rid", "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "4", "TORCHELASTIC_ERROR_FILE": error_file("/d", 2, 3),
        "RINGLET_AGENT_STORE": "1", "RINGLET_STORE_TOKEN_FILE": "/d/tok", "RINGLET_RUN_DIR": "/d",
        "RINGLET_GENERATION": "2", "RINGLET_LAUNCHER_PID": "55", "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
    }


@pytest.mark.timeout(60)
def test_worker_env_omp_bounds_and_command() -> None:
    def env(cfg: LaunchConfig, local_rank: int, base: dict[str, str]) -> dict[str, str]:
        return worker_env(cfg, local_rank, 0, 1, run_id="r", run_dir="/d", token_file="/d/t",
                          base_env=base)

    two = LaunchConfig(entrypoint="t.py", nproc_per_node=2)
    assert env(two, 0, {"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "8"
    assert "OMP_NUM_THREADS" not in env(LaunchConfig(entrypoint="t.py"), 0, {})
    with pytest.raises(ValueError, match="expected 0 <= local_rank < 2, got 2"):
        env(two, 2, {})
    boot = ["py", WORKER_FILE]
    assert worker_command(parse_args(["t.py", "a"]), "py") == [*boot, "t.py", "a"]
    assert worker_command(parse_args(["-m", "p.q", "a"]), "py") == [*boot, "-m", "p.q", "a"]
    assert worker_command(parse_args(["--no-python", "sh", "-c", "x"]), "py") == [
        *boot, "--no-python", "sh", "-c", "x"]


@pytest.mark.timeout(60)
def test_exit_descriptions_error_files_and_summary(tmp_path: Path) -> None:
    assert describe_exit(3) == "exit code 3"
    assert describe_exit(-signal.SIGSEGV) == "signal SIGSEGV"
    ours = tmp_path / "ours.json"
    ours.write_text(json.dumps({"timestamp": 5.0, "traceback": "Traceback\nKeyError: 1\n"}))
    torch_style = tmp_path / "torch.json"
    torch_style.write_text(json.dumps({"message": {"message": "m", "extraInfo": {
        "py_callstack": "TB", "timestamp": "7"}}}))
    assert read_error_file(str(torch_style)) == {
        "message": "m", "traceback": "TB", "timestamp": 7.0}
    assert read_error_file(str(tmp_path / "missing.json")) is None
    first = WorkerFailure(rank=1, local_rank=1, pid=42, returncode=1, timestamp=5.0,
                          error=read_error_file(str(ours)))
    other = WorkerFailure(rank=0, local_rank=0, pid=41, returncode=-9, timestamp=6.0, error=None)
    text = failure_summary(first, [other], 3, "rid")
    for needle in ("after 3 attempt(s) (run id rid)", "rank 1 (local rank 1), pid 42, exit code 1",
                   "    KeyError: 1", "also failed: rank 0, pid 41, signal SIGKILL"):
        assert needle in text


# ---------------------------------------------------------------- end to end

PRELUDE = """\
import os, signal, sys, time
from pathlib import Path
RANK = int(os.environ["RANK"])
OUT = Path(sys.argv[1])
(OUT / f"pid{RANK}.gen{os.environ['TORCHELASTIC_RESTART_COUNT']}").write_text(str(os.getpid()))
"""


def _script(tmp_path: Path, body: str, name: str = "job.py") -> Path:
    path = tmp_path / name
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("OMP_NUM_THREADS", None)
    return env


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _worker_pids(out: Path) -> list[int]:
    return [int(p.read_text()) for p in out.glob("pid*") if p.read_text()]


@contextmanager
def _launcher(tmp_path: Path, *argv: str, module: str = "ringlet.launcher.run"
              ) -> Iterator[subprocess.Popen[str]]:
    """Start ringlet-run; on exit kill it, its workers, and reap it, whatever happened."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *argv], cwd=tmp_path, env=_env(), text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        yield proc
    finally:
        for pid in [proc.pid, *_worker_pids(tmp_path)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.communicate(timeout=30)


def _launch(tmp_path: Path, *argv: str, timeout: float = 30) -> tuple[int, str, str, float]:
    start = time.monotonic()
    with _launcher(tmp_path, *argv) as proc:
        out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, time.monotonic() - start


def _wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_two_workers_get_env_and_prefixed_output(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import socket
        socket.create_connection(("127.0.0.1", int(os.environ["MASTER_PORT"])), timeout=5).close()
        tok = os.environ["RINGLET_STORE_TOKEN_FILE"]
        print("env", RANK, os.environ["WORLD_SIZE"], os.environ["MASTER_PORT"],
              os.environ["LOCAL_RANK"], os.environ["OMP_NUM_THREADS"],
              oct(os.stat(tok).st_mode & 0o777), oct(os.stat(os.path.dirname(tok)).st_mode & 0o777))
        print("to stderr", file=sys.stderr)
        (OUT / f"paths{RANK}").write_text(tok + "\\n" + os.environ["RINGLET_RUN_DIR"])
    """)
    code, out, err, _ = _launch(tmp_path, "--nproc-per-node", "2", str(script), str(tmp_path))
    assert code == 0, err
    rows = sorted(line.split() for line in out.splitlines() if " env " in line)
    assert [row[:5] for row in rows] == [["[rank0]:", "env", "0", "2", rows[0][4]],
                                         ["[rank1]:", "env", "1", "2", rows[0][4]]]
    assert int(rows[0][4]) > 0, "MASTER_PORT must be the port the store really bound"
    assert [row[5:] for row in rows] == [["0", "1", "0o600", "0o700"], ["1", "1", "0o600", "0o700"]]
    assert "[rank0]: to stderr" in err and "[rank1]: to stderr" in err
    assert "OMP_NUM_THREADS=1" in err
    token_file, run_dir = (tmp_path / "paths0").read_text().split("\n")
    assert not os.path.exists(token_file) and not os.path.exists(run_dir)
    with pytest.raises(ConnectionRefusedError):  # the store's listening socket is closed
        socket.create_connection(("127.0.0.1", int(rows[0][4])), timeout=5).close()


@pytest.mark.timeout(60)
def test_workers_use_the_launchers_store_across_generations(tmp_path: Path) -> None:
    # The token comes from RINGLET_STORE_TOKEN_FILE; the store outlives a failed generation.
    script = _script(tmp_path, """
        from datetime import timedelta
        from ringlet.store import TCPStore
        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         timeout=timedelta(seconds=10))
        gen = os.environ["RINGLET_GENERATION"]
        total = store.add("attempts", 1)
        store.set(f"gen{gen}/rank{RANK}", str(os.getpid()))
        store.wait([f"gen{gen}/rank{1 - RANK}"])
        print("gen", gen, "attempts so far", total)
        sys.exit(1 if gen == "0" else 0)
    """)
    code, out, err, _ = _launch(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1",
                                str(script), str(tmp_path))
    assert code == 0, err
    counts = sorted(int(line.split()[-1]) for line in out.splitlines() if " gen 1 " in line)
    assert len(counts) == 2 and counts[1] == 4, out


@pytest.mark.timeout(60)
def test_raising_rank_is_reported_and_peer_terminated(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        def step():
            raise ValueError(f"boom from rank {RANK}")
        if RANK == 1:
            time.sleep(0.3)
            step()
        time.sleep(30)
    """)
    code, _, err, elapsed = _launch(tmp_path, "--nproc_per_node=2", str(script), str(tmp_path))
    assert code == 1
    assert elapsed < 10, "the sleeping rank was not terminated promptly"
    summary = err[err.index("job failed"):]
    pid1 = (tmp_path / "pid1.gen0").read_text()
    assert f"first failure: rank 1 (local rank 1), pid {pid1}, exit code 1" in summary
    assert "in step" in summary and "ValueError: boom from rank 1" in summary
    assert "_worker.py" not in summary, "bootstrap frames should be trimmed"
    assert not any(_alive(p) for p in _worker_pids(tmp_path))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGSEGV"])
def test_worker_killed_by_signal_is_named(tmp_path: Path, sig: str) -> None:
    script = _script(tmp_path, f"""
        import resource
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if RANK == 0:
            os.kill(os.getpid(), signal.{sig})
        time.sleep(30)
    """)
    code, _, err, elapsed = _launch(tmp_path, "--nproc-per-node", "2", str(script), str(tmp_path))
    assert code == 1 and elapsed < 10
    assert f"first failure: rank 0 (local rank 0), pid {(tmp_path / 'pid0.gen0').read_text()}, " \
           f"signal {sig}" in err
    # @record cannot help against a signal: the summary says what can
    assert "errors.record" not in err
    hint = "out-of-memory killer" if sig == "SIGKILL" else "faulthandler printed the Python stack"
    assert hint in err, err


@pytest.mark.timeout(60)
def test_max_restarts_gives_exactly_three_attempts(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        with open(OUT / "attempts", "a") as f:
            f.write(f"{RANK} {os.environ['TORCHELASTIC_RESTART_COUNT']} "
                    f"{os.environ['RINGLET_GENERATION']}\\n")
        sys.exit(3)
    """)
    code, _, err, _ = _launch(tmp_path, "--max-restarts", "2", str(script), str(tmp_path))
    assert code == 1
    assert (tmp_path / "attempts").read_text().splitlines() == ["0 0 0", "0 1 1", "0 2 2"]
    assert err.count("restarting workers") == 2
    assert "job failed after 3 attempt(s)" in err and "exit code 3" in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("sig", "ignore_term"), [
    (signal.SIGTERM, False), (signal.SIGTERM, True), (signal.SIGINT, False)])
def test_signalled_launcher_stops_workers(tmp_path: Path, sig: int, ignore_term: bool) -> None:
    script = _script(tmp_path, f"""
        if {ignore_term}:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (OUT / f"ready{{RANK}}").write_text("")
        time.sleep(30)
    """)
    with _launcher(tmp_path, "--nproc-per-node", "2", "--grace-period", "1",
                   str(script), str(tmp_path)) as proc:
        _wait_for(lambda: len(list(tmp_path.glob("ready*"))) == 2)
        pids = _worker_pids(tmp_path)
        start = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=20)
        elapsed = time.monotonic() - start
    assert proc.returncode == 128 + sig, err
    assert elapsed < (3.0 if ignore_term else 2.0)
    assert not any(_alive(p) for p in pids)
    assert f"stopped workers on {signal.Signals(sig).name}" in err


@pytest.mark.timeout(60)
def test_sigkilled_launcher_takes_workers_down(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        (OUT / f"ready{RANK}").write_text(os.environ["RINGLET_RUN_DIR"])
        time.sleep(30)
    """)
    try:
        with _launcher(tmp_path, "--nproc-per-node", "2", str(script), str(tmp_path)) as proc:
            _wait_for(lambda: len(list(tmp_path.glob("ready*"))) == 2)
            pids = _worker_pids(tmp_path)
            proc.kill()
            proc.wait(timeout=10)
            _wait_for(lambda: not any(_alive(p) for p in pids), timeout=2.0)
    finally:
        # A SIGKILLed launcher cannot remove its run directory; the test does.
        for ready in tmp_path.glob("ready*"):
            shutil.rmtree(ready.read_text(), ignore_errors=True)


@pytest.mark.timeout(60)
def test_multiprocessing_spawn_inside_a_launched_script(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        import multiprocessing as mp

        def child(q, rank):
            q.put(f"child of rank {rank} ok")

        if __name__ == "__main__":
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            p = ctx.Process(target=child, args=(q, RANK))
            p.start()
            print(q.get(timeout=20))
            p.join(timeout=20)
            print("main guard ran, argv", sys.argv[1:] == [str(OUT)])
    """)
    code, out, err, _ = _launch(tmp_path, str(script), str(tmp_path))
    assert code == 0, err
    assert "[rank0]: child of rank 0 ok" in out
    assert "[rank0]: main guard ran, argv True" in out


@pytest.mark.timeout(60)
def test_module_and_no_python_modes(tmp_path: Path) -> None:
    (tmp_path / "mymod.py").write_text(
        "import os, sys\nif __name__ == '__main__':\n"
        "    print('mod', os.environ['RANK'], sys.argv[1:])\n")
    code, out, err, _ = _launch(tmp_path, "--nproc-per-node", "2", "-m", "mymod", "x")
    assert code == 0, err
    assert "[rank0]: mod 0 ['x']" in out and "[rank1]: mod 1 ['x']" in out
    code, out, err, _ = _launch(tmp_path, "--no-python", "sh", "-c", "echo sh $RANK; exit 4")
    assert code == 1 and "[rank0]: sh 0" in out and "exit code 4" in err


@pytest.mark.timeout(60)
def test_startup_errors_and_mirror_module(tmp_path: Path) -> None:
    with _launcher(tmp_path, "--nnodes", "2", "--node-rank", "1", "t.py",
                   module="ringlet.distributed.run") as proc:
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 2 and "expected --master-port" in err, err
    code, _, err, _ = _launch(tmp_path, "--nproc-per-node", "zero", "t.py")
    assert code == 2 and "expected a positive integer, 'cpu' or 'auto', got 'zero'" in err
    (tmp_path / "t.py").write_text("")   # exists: the port is what fails below
    with socket.create_server(("127.0.0.1", 0)) as taken:  # docs/reliability.md, row S1
        port = str(taken.getsockname()[1])
        code, _, err, elapsed = _launch(tmp_path, "--master-port", port, "t.py")
    assert code == 1 and elapsed < 10
    assert f"could not host the store on 127.0.0.1:{port}" in err
