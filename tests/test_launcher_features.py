"""ringlet-run's torchrun-style output (--log-dir, -r, -t, --local-ranks-filter, colour), the
heartbeat, @record, the legacy ``python -m ringlet.distributed.launch`` and blocking waits; pure
planning first, then end-to-end launches (torch-free scripts except where ringlet is the point)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_launcher import PRELUDE, _env, _launch, _launcher, _script, _wait_for

from ringlet.launcher import parse_args, worker_command, worker_env
from ringlet.launcher._capacity import Limits, max_workers
from ringlet.launcher._logs import (
    log_paths,
    parse_ranks_filter,
    parse_std,
    stream_plan,
    wants_files,
)
from ringlet.launcher._plan import WORKER_FILE
from ringlet.launcher._watch import Heartbeats

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------- plan (pure)
def test_stream_specs_and_plans() -> None:
    assert parse_std("3") == (3, {}) and parse_std("0:1, 1:2") == (0, {0: 1, 1: 2})
    assert parse_ranks_filter("") is None and parse_ranks_filter("0,2") == frozenset({0, 2})
    plain = stream_plan(0, None, "0", "0", "")
    assert (plain.console_out, plain.console_err, plain.file_out,
            plain.file_err) == (True, True, False, False)
    logged = stream_plan(1, "/logs", "0", "0", "0")       # --log-dir: files for everything
    assert (logged.console_out, logged.file_out, logged.file_err) == (False, True, True)
    redirected = stream_plan(0, None, "0:1", "1:2", "")    # rank 0: stdout to file only
    assert (redirected.console_out, redirected.console_err,
            redirected.file_out) == (False, True, True)
    teed = stream_plan(1, None, "0:1", "1:2", "")          # rank 1: stderr to file and console
    assert (teed.console_err, teed.file_err, teed.file_out) == (True, True, False)
    assert (not wants_files(None, "0", "0:0") and wants_files(None, "0", "1:2")
            and wants_files("/d", "0", "0"))
    assert log_paths("/r", 2, 3) == ("/r/attempt_2/3/stdout.log", "/r/attempt_2/3/stderr.log")


def test_new_flags_and_legacy_launch_parsing() -> None:
    cfg = parse_args(["--log_dir", "/l", "-r", "3", "-t", "0:2", "--local_ranks_filter", "0",
                      "--heartbeat-timeout", "30", "t.py"])
    assert (cfg.log_dir, cfg.redirects, cfg.tee, cfg.local_ranks_filter, cfg.heartbeat_timeout) == (
        "/l", "3", "0:2", "0", 30.0)
    assert cfg.local_rank_arg is None
    old = parse_args(["--nproc-per-node", "2", "t.py", "--lr", "1"], legacy_launch=True)
    boot = ["py", WORKER_FILE]
    assert worker_command(old, "py", local_rank=1) == [*boot, "t.py", "--local-rank=1", "--lr", "1"]
    under = parse_args(["--local-rank-spelling", "underscore", "t.py"], legacy_launch=True)
    assert worker_command(under, "py", local_rank=0)[-1] == "--local_rank=0"
    env_style = parse_args(["--use_env", "t.py"], legacy_launch=True)
    assert worker_command(env_style, "py", local_rank=0) == [*boot, "t.py"]
    with pytest.raises(ValueError, match="expected --use-env with --no-python"):
        parse_args(["--no-python", "sh"], legacy_launch=True)
    with pytest.raises(ValueError, match="unrecognized arguments"):
        parse_args(["--use-env", "t.py"])                  # ringlet-run itself has no --use-env
    env = worker_env(cfg, 0, 0, 1, run_id="r", run_dir="/d", token_file="/t", base_env={},
                     heartbeat_file="/d/hb")
    assert env["RINGLET_HEARTBEAT_FILE"] == "/d/hb"
    assert "RINGLET_HEARTBEAT_FILE" not in worker_env(cfg, 0, 0, 1, run_id="r", run_dir="/d",
                                                      token_file="/t",
                                                      base_env={"RINGLET_HEARTBEAT_FILE": "/x"})


def test_capacity_bound_names_the_scarcest_resource() -> None:
    n, why = max_workers(Limits(open_files=20000, user_processes_free=50, pids_free=30000,
                                mem_available=64 << 30))
    assert n == 50 and "this user may start 50 more" in why
    n, why = max_workers(Limits(open_files=None, user_processes_free=None, pids_free=None,
                                mem_available=1 << 30))
    assert n == 32 and "memory" in why


def test_heartbeats_watch_from_the_first_beat(tmp_path: Path) -> None:
    hb = Heartbeats([str(tmp_path / "a"), str(tmp_path / "b")], timeout=1.0)
    hb.create()
    try:
        hb.started()
        assert hb.silent(time.monotonic() + 10) == {}      # never beat: start-up is not watched
        fd = os.open(tmp_path / "a", os.O_RDWR)
        os.pwrite(fd, (1).to_bytes(8, sys.byteorder), 0)  # worker a beats once
        now = time.monotonic()
        assert hb.silent(now) == {}
        assert set(hb.silent(now + 1.5)) == {0}
        os.pwrite(fd, (2).to_bytes(8, sys.byteorder), 0)
        os.close(fd)
        assert hb.silent(now + 1.6) == {}                  # it moved again
    finally:
        hb.close()
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------- end to end
@pytest.mark.timeout(60)
def test_log_dir_redirects_filter_and_summary(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        gen = os.environ["TORCHELASTIC_RESTART_COUNT"]
        print(f"out {RANK} gen {gen}")
        print(f"err {RANK} gen {gen}", file=sys.stderr)
        (OUT / f"printed{RANK}.gen{gen}").touch()
        if RANK == 1:   # only once rank 0 has printed: it is stopped when rank 1 fails
            deadline = time.monotonic() + 30
            while not (OUT / f"printed0.gen{gen}").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
            raise ValueError(f"boom in gen {gen}")
    """)
    logs = tmp_path / "logs"
    code, out, err, _ = _launch(tmp_path, "--nproc-per-node", "2", "--max-restarts", "1",
                                "--rdzv-id", "job",
                                "--log-dir", str(logs), "-r", "1:1", "--local-ranks-filter", "1",
                                str(script), str(tmp_path))
    assert code == 1
    root = logs / "job"
    for attempt in (0, 1):
        for lr in (0, 1):
            folder = root / f"attempt_{attempt}" / str(lr)
            assert (folder / "stdout.log").read_text() == f"out {lr} gen {attempt}\n"
            assert (folder / "stderr.log").read_text().startswith(f"err {lr} gen {attempt}\n")
    assert "boom in gen 1" in (root / "attempt_1" / "1" / "stderr.log").read_text()
    assert "[rank0]" not in out + err.replace("rank 0", "")      # filtered out of the console
    assert "out 1" not in out                                     # rank 1's stdout: file only
    assert "[rank1]: err 1 gen 0" in err
    assert f"log: {root}/attempt_1/1/stdout.log {root}/attempt_1/1/stderr.log" in err
    assert "ValueError: boom in gen 1" in err


@pytest.mark.timeout(60)
def test_tee_without_log_dir_uses_a_fresh_folder(tmp_path: Path) -> None:
    script = _script(tmp_path, """
        print(f"out {RANK}")
        print(f"err {RANK}", file=sys.stderr)
    """)
    code, out, err, _ = _launch(tmp_path, "--nproc-per-node", "1", "-t", "2", str(script),
                                str(tmp_path))
    assert code == 0, err
    root = Path(re.search(r"worker logs: (\S+)/attempt_<n>", err).group(1))  # type: ignore[union-attr]
    try:
        assert (root / "attempt_0" / "0" / "stderr.log").read_text() == "err 0\n"
        assert not (root / "attempt_0" / "0" / "stdout.log").exists()
        assert "[rank0]: out 0" in out and "[rank0]: err 0" in err
    finally:
        import shutil

        shutil.rmtree(root)


@pytest.mark.timeout(60)
def test_prefix_is_coloured_on_a_terminal_only(tmp_path: Path) -> None:
    script = _script(tmp_path, 'print("hi", RANK)\n')
    main, child = pty.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "ringlet.launcher.run",
                               "--nproc-per-node", "2",
                               str(script), str(tmp_path)], cwd=tmp_path, env=_env(), stdout=child,
                              stderr=subprocess.PIPE, timeout=30)
        os.close(child)
        child = -1
        data = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(main)
        if child >= 0:
            os.close(child)
    assert proc.returncode == 0
    assert b"\x1b[36m[rank0]:\x1b[0m hi 0" in data and b"\x1b[33m[rank1]:\x1b[0m hi 1" in data
    assert b"\x1b[" not in proc.stderr       # stderr was a pipe: plain


@pytest.mark.timeout(90)
def test_legacy_launch_passes_local_rank(tmp_path: Path) -> None:
    script = tmp_path / "old.py"
    script.write_text('import os, sys\nprint("argv", os.environ["RANK"], os.environ["LOCAL_RANK"], '
                      '*sys.argv[1:])\n')
    for flags, expect in (([], "--local-rank={lr}"), (["--local_rank_spelling", "underscore"],
                                                          "--local_rank={lr}"),
                          (["--use-env"], "")):
        with _launcher(tmp_path, "--nproc-per-node", "2", *flags, str(script), "x",
                       module="ringlet.launcher.launch") as proc:
            out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        rows = sorted(line.split(maxsplit=1)[1] for line in out.splitlines() if " argv " in line)
        # the flag comes right after the script, before its own arguments (as torch's launch)
        assert (rows
                == [f"argv {lr} {lr} {expect.format(lr=lr)} x".replace("  ", " ")
                    for lr in (0, 1)]), rows
        assert "deprecated" in err


@pytest.mark.timeout(90)
def test_torch_path_of_the_legacy_launcher(tmp_path: Path) -> None:
    script = tmp_path / "old.py"
    script.write_text('import sys\nprint("argv", *sys.argv[1:])\n')
    with _launcher(tmp_path, "--nproc-per-node", "1", str(script),
                   module="ringlet.distributed.launch") as proc:
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "[rank0]: argv --local-rank=0" in out


_RECORDED = """
import sys
from ringlet.distributed.elastic.multiprocessing.errors import record

def helper():
    raise KeyError("recorded-key")

@record
def main():
    helper()

main()
"""


@pytest.mark.timeout(90)
def test_record_reaches_the_summary_without_the_bootstrap(tmp_path: Path) -> None:
    """With --no-python the bootstrap's excepthook is not there; @record alone writes the error
    file that the summary shows."""
    (tmp_path / "rec.py").write_text(_RECORDED)
    code, _out, err, _ = _launch(tmp_path, "--nproc-per-node", "1", "--no-python", sys.executable,
                                 str(tmp_path / "rec.py"), timeout=60)
    assert code == 1
    summary = err[err.index("job failed"):]
    assert ("KeyError: 'recorded-key'" in summary and 'in helper' in summary
            and "traceback:" in summary)


def test_record_at_torchs_path_and_its_exit_rules() -> None:
    from ringlet.distributed.elastic.multiprocessing.errors import record
    from ringlet.launcher import errors

    assert record is errors.record

    @record
    def quits(code: int | None) -> int:
        raise SystemExit(code)

    assert quits(0) is None and quits(None) is None
    with pytest.raises(SystemExit):
        quits(3)


_HANGS = """
import os, sys, time
import torch
import ringlet.distributed as dist
from ringlet.distributed.elastic import heartbeat
dist.init_process_group("shm")
gen = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
t0 = time.time()
while time.time() - t0 < 2.0:          # collectives beat for us: longer than the timeout
    dist.all_reduce(torch.ones(1)); time.sleep(0.05)
t0 = time.time()
while time.time() - t0 < 2.0:          # so do explicit beats in a phase without communication
    heartbeat(); time.sleep(0.1)
if dist.get_rank() == 1 and gen == 0:
    print("hanging now", flush=True)
    while True:
        time.sleep(1)
dist.destroy_process_group()
print("finished generation", gen)
"""


@pytest.mark.timeout(120)
def test_hung_worker_is_killed_and_counts_as_a_failure(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(_HANGS)
    code, out, err, elapsed = _launch(tmp_path, "--nproc-per-node", "2",
                                      "--heartbeat-timeout", "1.2",
                                      "--max-restarts", "1", str(tmp_path / "hang.py"), timeout=100)
    assert code == 0, err
    assert "[rank1]: hanging now" in out
    assert re.search(r"rank 1 \(pid \d+\) failed with no progress for 1\.\d s "
                     r"\(--heartbeat-timeout\); hung, killed with SIGKILL; restarting workers "
                     r"\(1/1\)", err), err
    # its stacks, printed before the kill, show where it hung
    assert ("most recent call first" in err
            and re.search(r'hang\.py", line 1\d in <module>', err)), err
    assert (out.count("finished generation 1") == 2
            and "rank0" not in err.split("restarting")[0][-200:])


_SLEEPS = PRELUDE + """
(OUT / f"pid{RANK}").write_text(str(os.getpid()))
time.sleep(2.5)
"""


def _voluntary_switches(pid: int) -> int:
    text = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return int(re.search(r"voluntary_ctxt_switches:\s+(\d+)", text).group(1))  # type: ignore[union-attr]


@pytest.mark.timeout(60)
def test_launcher_blocks_while_its_workers_run(tmp_path: Path) -> None:
    """The launcher's main thread sleeps in select() on the workers' pidfds: it does not wake up
    every --monitor-interval (0.1 s by default) while nothing happens."""
    (tmp_path / "job.py").write_text(_SLEEPS)
    with _launcher(tmp_path, "--nproc-per-node", "2", str(tmp_path / "job.py"),
                   str(tmp_path)) as proc:
        _wait_for(lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid1").exists())
        time.sleep(0.3)
        before = _voluntary_switches(proc.pid)
        time.sleep(1.0)
        woke = _voluntary_switches(proc.pid) - before
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    assert woke <= 2, f"the launcher's main thread woke {woke} times in 1 s while its workers slept"
