"""ringlet-run across nodes: flags, scheduler environments (fake Slurm/MPI), run tokens, and
end-to-end launches -- two launchers on one host, and one launcher per simulated host."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from netns import SimNet, require_netns

from ringlet.launcher import LaunchConfig, parse_args, worker_env
from ringlet.launcher._runtime import shared_token
from ringlet.launcher._schedulers import detect, expand_nodelist

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- plan (pure)


@pytest.mark.timeout(30)
def test_multinode_flags_in_both_spellings() -> None:
    for flags in (["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1",
                   "--master-port", "29500",
                   "--rdzv-token-file", "/t", "--rdzv-timeout", "7", "--rdzv-id", "j"],
                  ["--nnodes=2", "--node_rank=1", "--master_addr=10.0.0.1", "--master_port=29500",
                   "--rdzv_token_file=/t", "--rdzv_timeout=7", "--rdzv_id=j"]):
        cfg = parse_args([*flags, "--nproc_per_node", "4", "train.py", "-x"])
        assert (cfg.nnodes, cfg.node_rank, cfg.master_addr,
                cfg.master_port) == (2, 1, "10.0.0.1", 29500)
        assert (cfg.token_file, cfg.rdzv_timeout, cfg.rdzv_id,
                cfg.world_size) == ("/t", 7.0, "j", 8)
        assert [cfg.global_rank(i) for i in range(4)] == [4, 5, 6, 7]
    ep = parse_args(["--nnodes", "2", "--rdzv-endpoint", "head:1234", "t.py"])
    assert (ep.master_addr, ep.master_port, ep.node_rank) == ("head", 1234, 0)
    with pytest.raises(ValueError, match="expected --master-port .* for node rank 1, got 0"):
        parse_args(["--nnodes", "2", "--node-rank", "1", "t.py"])
    with pytest.raises(ValueError, match="no --nnodes/--node-rank with --from-env"):
        parse_args(["--from-env", "slurm", "--nnodes", "2", "t.py"], env={})
    assert parse_args(["--nnodes", "2", "t.py"]).master_port == 0     # node 0 may pick its port


SLURM_NODES = {"SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
               "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}
SLURM_TASKS = {"SLURM_NTASKS": "4", "SLURM_PROCID": "3", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
               "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x2)",
               "SLURM_STEP_NODELIST": "n1,n2"}


@pytest.mark.timeout(30)
def test_scheduler_environments() -> None:
    p = detect("slurm", SLURM_NODES, 4)
    assert (p.nnodes, p.node_rank, p.nproc_per_node, p.master_addr,
            p.master_port) == (2, 1, 4, "gpu07", 23456)
    assert p.source == "slurm, one task per node"
    p = detect("auto", SLURM_TASKS, 1)
    assert (p.nnodes, p.node_rank, p.local_rank_base, p.local_world_size,
            p.master_addr) == (4, 3, 1, 2, "n1")
    with pytest.raises(ValueError, match="expected --nproc-per-node 1, got 2"):
        detect("slurm", SLURM_TASKS, 2)
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    p = detect("auto", ompi, 1)
    assert (p.nnodes, p.node_rank, p.local_rank_base, p.local_world_size,
            p.master_addr) == (8, 5, 1, 4, None)
    p = detect("mpi", {"PMI_RANK": "2", "PMI_SIZE": "3"}, 1)
    assert (p.nnodes, p.node_rank) == (3, 2)
    with pytest.raises(ValueError, match="expected SLURM_PROCID in the environment"):
        detect("slurm", {"SLURM_NTASKS": "2"}, 1)
    with pytest.raises(ValueError, match="got neither"):
        detect("auto", {}, 1)
    assert expand_nodelist("a[01-03,7],b,c[9-10]x") == ["a01", "a02", "a03", "a7", "b",
                                                        "c9x", "c10x"]
    with pytest.raises(ValueError, match="expected a Slurm node list"):
        expand_nodelist("a[1-2")
    cfg = parse_args(["--from-env", "auto", "t.py"], env={**SLURM_TASKS, "MASTER_PORT": "4000"})
    assert (cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port,
            cfg.world_size) == (4, 3, "n1", 4000, 4)
    env = worker_env(cfg, 0, 0, 4000, run_id="r", run_dir="/d", token_file="/d/t",
                     base_env={"RINGLET_STORE_TOKEN": "secret"})
    assert (env["RANK"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"],
            env["GROUP_RANK"]) == ("3", "1", "2", "3")
    assert "RINGLET_STORE_TOKEN" not in env and env["RINGLET_STORE_TOKEN_FILE"] == "/d/t"
    with pytest.raises(ValueError, match="expected --master-addr and --master-port"):
        parse_args(["--from-env", "mpi", "t.py"], env=ompi)


@pytest.mark.timeout(30)
def test_run_token_sources(tmp_path: Path) -> None:
    cfg = LaunchConfig(entrypoint="t.py", nnodes=2, master_addr="10.0.0.1", master_port=1)
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    tok.chmod(0o600)
    assert shared_token(LaunchConfig(entrypoint="t.py", nnodes=2, master_addr="10.0.0.1",
                                     master_port=1, token_file=str(tok)), env={}) == b"s3cret"
    assert shared_token(cfg, env={"RINGLET_STORE_TOKEN_FILE": str(tok)}) == b"s3cret"
    assert shared_token(cfg, env={"RINGLET_STORE_TOKEN": "e"}) == b"e"
    tok.chmod(0o644)
    with pytest.raises(ValueError, match="readable by its owner only"):
        shared_token(cfg, env={"RINGLET_STORE_TOKEN_FILE": str(tok)})
    with pytest.raises(ValueError, match="--rdzv-token-file"):
        shared_token(cfg, env={})
    loop = LaunchConfig(entrypoint="t.py", nnodes=2, master_addr="127.0.0.1", master_port=1)
    assert shared_token(loop, env={}) == b""


# ---------------------------------------------------------------- end to end (loopback)

JOB = """\
import os, sys, time
from datetime import timedelta
from pathlib import Path
from ringlet.store import TCPStore
OUT, RANK, WORLD = Path(sys.argv[1]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
GEN = os.environ["TORCHELASTIC_RESTART_COUNT"]
(OUT / f"pid{RANK}.gen{GEN}").write_text(str(os.getpid()))
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                 timeout=timedelta(seconds=20))
store.set(f"gen{GEN}/rank{RANK}", os.environ["GROUP_RANK"])
store.wait([f"gen{GEN}/rank{r}" for r in range(WORLD)])
print("job", RANK, WORLD, os.environ["LOCAL_RANK"], os.environ["GROUP_RANK"],
      os.environ["TORCHELASTIC_RUN_ID"], "RINGLET_STORE_TOKEN" in os.environ, flush=True)
fail = os.environ.get("FAIL_RANK")
if fail is not None and RANK == int(fail) and GEN == os.environ.get("FAIL_GEN", GEN):
    raise SystemExit(3)
time.sleep(float(os.environ.get("LINGER", "0")))
"""


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("RINGLET_STORE_TOKEN", None)
    env.pop("RINGLET_STORE_TOKEN_FILE", None)
    env.update(extra)
    return env


@contextmanager
def _launchers(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """Launchers started by the body; all killed (with their workers) and reaped on exit."""
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        pids = [p.pid for p in procs] + [int(f.read_text()) for f in tmp_path.glob("pid*")
                                         if f.read_text()]
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in procs:
            p.communicate(timeout=30)


def _start(procs: list, tmp_path: Path, node: int, *argv: str, env: dict[str, str] | None = None,
           prefix: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    script = tmp_path / "job.py"
    if not script.exists():
        script.write_text(JOB)
    cmd = [*prefix, sys.executable, "-m", "ringlet.launcher.run", *argv, str(script), str(tmp_path)]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env or _env(), text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    procs.append(p)
    return p


def _port_of(p: subprocess.Popen[str], timeout: float = 30) -> int:
    """Node 0 prints where its store listens; read it from its stderr."""
    deadline = time.monotonic() + timeout
    assert p.stderr is not None
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        m = re.search(r"hosts the rendezvous store at \S+:(\d+)", line)
        if m:
            return int(m.group(1))
        if not line and p.poll() is not None:
            break
    raise AssertionError("node 0 never said where its store listens")


@pytest.mark.timeout(90)
def test_two_nodes_restart_together_after_a_failure_on_one(tmp_path: Path) -> None:
    env = _env(FAIL_RANK="3", FAIL_GEN="0")
    with _launchers(tmp_path) as procs:
        common = ["--nnodes", "2", "--nproc-per-node", "2", "--max-restarts", "1",
                  "--rdzv-timeout", "30"]
        n0 = _start(procs, tmp_path, 0, *common, "--node-rank", "0", "--master-port", "0", env=env)
        port = _port_of(n0)
        n1 = _start(procs, tmp_path, 1, *common, "--node-rank", "1", "--master-port",
                    str(port), env=env)
        out1, err1 = n1.communicate(timeout=60)
        out0, err0 = n0.communicate(timeout=30)
    assert n0.returncode == 0 and n1.returncode == 0, err0 + err1
    rows = sorted(line.split()[2:] for line in (out0 + out1).splitlines() if " job " in line)
    run_id = rows[0][4]
    assert len(rows) == 8    # two generations of four ranks
    assert {tuple(r) for r in rows} == {(str(r), "4", str(r % 2), str(r // 2), run_id, "False")
                                       for r in range(4)}
    assert "rank 3" in err0 and "restarting workers on every node (1/1)" in err0, err0
    assert "restarting workers on every node (1/1)" in err1


@pytest.mark.timeout(90)
def test_a_failed_node_ends_the_job_everywhere_with_its_traceback(tmp_path: Path) -> None:
    env = _env(FAIL_RANK="2", LINGER="30")
    with _launchers(tmp_path) as procs:
        common = ["--nnodes", "2", "--rdzv-timeout", "30"]
        n0 = _start(procs, tmp_path, 0, *common, "--node-rank", "0", "--master-port", "0", env=env)
        port = _port_of(n0)
        n1 = _start(procs, tmp_path, 1, *common, "--nproc-per-node", "2", "--node-rank", "1",
                    "--master-port", str(port), env=env)
        _, err1 = n1.communicate(timeout=60)
        _, err0 = n0.communicate(timeout=30)
    # node 0 runs 1 worker, node 1 runs 2: they disagree, and both say so before any worker starts
    assert n0.returncode == 1 and n1.returncode == 1
    assert "nodes disagree on nproc_per_node: node 0" in err0 and "node 1" in err0, err0
    assert "nodes disagree on nproc_per_node" in err1
    assert not list(tmp_path.glob("pid*"))

    with _launchers(tmp_path) as procs:
        common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-timeout", "30"]
        n0 = _start(procs, tmp_path, 0, *common, "--node-rank", "0", "--master-port", "0", env=env)
        port = _port_of(n0)
        t0 = time.monotonic()
        n1 = _start(procs, tmp_path, 1, *common, "--node-rank", "1", "--master-port",
                    str(port), env=env)
        _, err1 = n1.communicate(timeout=60)
        _, err0 = n0.communicate(timeout=30)
        elapsed = time.monotonic() - t0
    # not the workers' 30 s linger
    assert n0.returncode == 1 and n1.returncode == 1 and elapsed < 25
    assert ("first failure: rank 2 (pid" in err0 and "on node 1" in err0
            and "exit code 3" in err0), err0
    assert "SystemExit: 3" in err0 or "exit code 3" in err0
    assert "first failure: rank 2 (local rank 0)" in err1, err1


@pytest.mark.timeout(60)
def test_node_that_never_arrives_is_named(tmp_path: Path) -> None:
    with _launchers(tmp_path) as procs:
        n0 = _start(procs, tmp_path, 0, "--nnodes", "3", "--rdzv-timeout", "2",
                    "--master-port", "0")
        _, err = n0.communicate(timeout=40)
    assert n0.returncode == 1
    assert "nodes [1, 2] never reached the master at 127.0.0.1:" in err, err
    assert not list(tmp_path.glob("pid*"))


@pytest.mark.timeout(60)
def test_from_env_one_task_per_rank_like_srun(tmp_path: Path) -> None:
    base = {"SLURM_NTASKS": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": "2", "SLURM_JOB_NODELIST": "localhost"}
    with _launchers(tmp_path) as procs:
        t0 = _start(procs, tmp_path, 0, "--from-env", "slurm",
                    env=_env(**base, SLURM_PROCID="0", SLURM_LOCALID="0", MASTER_PORT="0"))
        port = _port_of(t0)
        t1 = _start(procs, tmp_path, 1, "--from-env", "slurm",
                    env=_env(**base, SLURM_PROCID="1", SLURM_LOCALID="1", MASTER_PORT=str(port)))
        out1, err1 = t1.communicate(timeout=40)
        out0, err0 = t0.communicate(timeout=30)
    assert t0.returncode == 0 and t1.returncode == 0, err0 + err1
    rows = sorted(line.split()[2:6] for line in (out0 + out1).splitlines() if " job " in line)
    # rank, world, LOCAL_RANK, GROUP_RANK
    assert rows == [["0", "2", "0", "0"], ["1", "2", "1", "1"]]


# ---------------------------------------------------------------- simulated hosts

TORCH_JOB = textwrap.dedent("""\
    import os, sys, json, torch
    import ringlet.distributed as dist
    dist.init_process_group()
    t = torch.arange(100_000, dtype=torch.float32) + dist.get_rank()
    dist.all_reduce(t)
    out = {"rank": dist.get_rank(), "backend": dist.get_backend(), "sum0": t[0].item(),
           "token_env": "RINGLET_STORE_TOKEN" in os.environ}
    with open(os.path.join(sys.argv[1], f"res{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
""")


@pytest.mark.timeout(120)
def test_two_node_job_across_simulated_hosts_with_a_token(tmp_path: Path) -> None:
    require_netns()
    import json

    (tmp_path / "job.py").write_text(TORCH_JOB)
    tok = tmp_path / "token"
    tok.write_text("multi-node-secret")
    tok.chmod(0o600)
    bad = tmp_path / "bad"
    bad.write_text("not-the-secret")
    bad.chmod(0o600)
    with SimNet(2) as net, _launchers(tmp_path) as procs:
        common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", net.addrs[0],
                  "--rdzv-timeout", "40"]
        pre = ("ip", "netns", "exec")
        n0 = _start(procs, tmp_path, 0, *common, "--node-rank", "0", "--master-port", "0",
                    "--rdzv-token-file", str(tok), prefix=(*pre, net.hosts[0]))
        port = _port_of(n0)
        probe = subprocess.run([*pre, net.hosts[0], sys.executable, "-c",
                                (f"import socket; socket.create_connection(('127.0.0.1', {port}), "
                                 "timeout=3)")],
                               capture_output=True, text=True, timeout=30)
        assert probe.returncode != 0 and "refused" in probe.stderr, ("the store must bind the "
                                                                     "master address only")
        intruder = _start(procs, tmp_path, 1, *common, "--node-rank", "1",
                          "--master-port", str(port),
                          "--rdzv-token-file", str(bad), "--rdzv-timeout", "3",
                          prefix=(*pre, net.hosts[1]))
        _, ierr = intruder.communicate(timeout=30)
        assert intruder.returncode == 1 and "bad run token" in ierr, ierr
        n1 = _start(procs, tmp_path, 1, *common, "--node-rank", "1", "--master-port", str(port),
                    "--rdzv-token-file", str(tok), prefix=(*pre, net.hosts[1]))
        _, err1 = n1.communicate(timeout=90)
        _, err0 = n0.communicate(timeout=30)
    assert n0.returncode == 0 and n1.returncode == 0, err0 + err1
    res = [json.loads((tmp_path / f"res{r}.json").read_text()) for r in range(4)]
    assert [r["backend"] for r in res] == ["shm+tcp"] * 4
    assert [r["sum0"] for r in res] == [6.0] * 4 and not any(r["token_env"] for r in res)


def _main_thread_switches(pid: int) -> int:
    text = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return int(re.search(r"voluntary_ctxt_switches:\s+(\d+)", text).group(1))  # type: ignore[union-attr]


@pytest.mark.timeout(90)
def test_launchers_block_instead_of_polling_the_store(tmp_path: Path) -> None:
    """While the workers run, each launcher's main thread sleeps until a worker exits or another
    node reports a failure (a helper thread blocks on the store and beats once a second)."""
    env = _env(LINGER="3")
    with _launchers(tmp_path) as procs:
        common = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-timeout", "30"]
        n0 = _start(procs, tmp_path, 0, *common, "--node-rank", "0", "--master-port", "0", env=env)
        port = _port_of(n0)
        n1 = _start(procs, tmp_path, 1, *common, "--node-rank", "1", "--master-port",
                    str(port), env=env)
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("pid*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)
        before = [_main_thread_switches(p.pid) for p in (n0, n1)]
        time.sleep(1.0)
        woke = [_main_thread_switches(p.pid) - b for p, b in zip((n0, n1), before, strict=True)]
        out1, err1 = n1.communicate(timeout=60)
        out0, err0 = n0.communicate(timeout=30)
    assert n0.returncode == 0 and n1.returncode == 0, err0 + err1
    assert max(woke) <= 2, (f"launcher main threads woke {woke} times in 1 s while their workers "
                            "slept")
