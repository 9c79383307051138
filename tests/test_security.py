"""Security: each attack of docs/security.md as an automated test.

1. Code execution through object collectives in restricted mode (``RINGLET_SAFE_OBJECTS=1``):
   a corpus of pickle gadgets sent by a hostile rank across real processes; none runs.
2. Joining a job started without a run token: another user, or a process that only reached the
   store, can neither use the store nor join the tcp mesh (host secret).
3. Blocking set-up: idle and garbage connections during the tcp mesh's set-up.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import _security_workers as W
import pytest

from ringlet.c10d import objects
from ringlet.errors import DistNetworkError, DistStoreError
from ringlet.store import FileStore, TCPStore
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport.tcp import wire

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]
SHORT = timedelta(seconds=5)

CALLABLE_GADGETS = [
    "os.system", "subprocess.call", "subprocess.Popen", "builtins.eval", "builtins.exec",
    "storage._load_from_bytes", "torch.load(weights_only=False)", "numpy.load",
    "functools.partial chain", "__reduce_ex__", "copyreg._reconstructor", "protocol-0 INST",
]


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.01)
    return path.exists()


# -- 1. restricted object mode -------------------------------------------------------------------
@pytest.mark.parametrize("name", CALLABLE_GADGETS)
def test_gadget_is_live_in_trusting_mode(name: str, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: each gadget of the corpus really runs code when decoded by a trusting receiver, so
    the restricted-mode test below proves something (the old allowlist let some of these
    through)."""
    monkeypatch.delenv("RINGLET_SAFE_OBJECTS", raising=False)
    sentinel = tmp_path / "pwned"
    payload, _ = W.gadgets(str(sentinel), str(tmp_path))[name]
    try:
        objects._decode(payload, 0, "control")
    except Exception:
        pass
    assert _wait_for(sentinel, 5.0), f"gadget {name} did not run even in trusting mode"


def test_gadget_corpus_refused_in_restricted_mode_in_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    sentinel = tmp_path / "pwned"
    for name, (payload, must_name) in W.gadgets(str(sentinel), str(tmp_path)).items():
        with pytest.raises(Exception) as info:
            objects._decode(payload, 3, "broadcast_object_list")
        msg = str(info.value)
        assert "refuses the object from rank 3" in msg, (name, msg)
        assert must_name in msg, (name, must_name, msg)
    time.sleep(0.2)   # a Popen gadget would create the file asynchronously
    assert not sentinel.exists()


@pytest.mark.timeout(90)
def test_gadget_corpus_refused_across_processes(tmp_path: Path) -> None:
    """A hostile rank 0 sends every gadget with broadcast_object_list; rank 1 refuses each one,
    naming the callable, and the group stays usable for the next gadget."""
    sentinel = tmp_path / "pwned"
    names = list(W.gadgets(str(sentinel), str(tmp_path)))
    res = run_world(2, W.gadget_round, names, str(sentinel), str(tmp_path), "broadcast_object_list",
                    env={"RINGLET_SAFE_OBJECTS": "1"}, timeout=60)
    raise_first(res)
    corpus = W.gadgets(str(sentinel), str(tmp_path))
    for name, outcome in zip(names, res[1].value, strict=True):
        assert (outcome.startswith("UnpicklingError")
                and "refuses the object from rank 0" in outcome), (name, outcome)
        assert corpus[name][1] in outcome, (name, outcome)
    time.sleep(0.2)
    assert not sentinel.exists()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("op", ["all_gather_object", "scatter_object_list", "send_object_list"])
def test_gadgets_refused_by_every_object_collective(op: str, tmp_path: Path) -> None:
    sentinel = tmp_path / "pwned"
    names = ["storage._load_from_bytes", "os.system"]
    res = run_world(2, W.gadget_round, names, str(sentinel), str(tmp_path), op,
                    env={"RINGLET_SAFE_OBJECTS": "1"}, timeout=60)
    raise_first(res)
    for name, outcome in zip(names, res[1].value, strict=True):
        assert "refuses the object from rank 0" in outcome, (op, name, outcome)
    assert not sentinel.exists()


def test_restricted_mode_still_carries_plain_data_and_tensors() -> None:
    res = run_world(2, W.plain_data_round, env={"RINGLET_SAFE_OBJECTS": "1"}, timeout=60)
    raise_first(res)
    for r in range(2):
        got = res[r].value
        assert [g["rank"] for g in got] == [0, 1]
        assert got[1]["t"] == [1.0, 2.0, 3.0]
        assert got[0]["s"] == {1, 2} and got[0]["b"] == b"x" and got[0]["c"] == 1 + 2j


def test_restricted_receiver_refuses_a_trusting_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RINGLET_SAFE_OBJECTS", raising=False)
    payload = objects._encode({"a": 1})
    assert payload is not None and payload[:4] == objects.MAGIC
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    with pytest.raises(Exception, match="plain pickle.*RINGLET_SAFE_OBJECTS=1 on every rank"):
        objects._decode(payload, 1, "all_gather_object")
    # ...while a trusting receiver reads a restricted sender's archive.
    safe = objects._encode({"a": 1})
    monkeypatch.delenv("RINGLET_SAFE_OBJECTS")
    assert safe is not None and objects._decode(safe, 1, "all_gather_object") == {"a": 1}


def test_force_no_weights_only_environment_cannot_weaken_restricted_mode(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    sentinel = tmp_path / "pwned"
    payload, _ = W.gadgets(str(sentinel), str(tmp_path))["os.system"]
    with pytest.raises(Exception, match="refuses"):
        objects._decode(payload, 0, "broadcast_object_list")
    assert not sentinel.exists()



# -- 2. authenticated by default on one host ----------------------------------------------------
def _master(**kw: object) -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=SHORT, **kw)


def _no_token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RINGLET_STORE_TOKEN", "RINGLET_STORE_TOKEN_FILE", "RINGLET_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)


def _child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGLET_STORE_TOKEN")}
    env.pop("RINGLET_RUNTIME_DIR", None)
    env.update(PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests")]),
               OMP_NUM_THREADS="1", **extra)
    return env


def test_store_without_token_admits_same_user_processes_of_this_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _no_token_env(monkeypatch)
    server = _master()
    try:
        code = ("import sys; from datetime import timedelta; from ringlet.store import TCPStore; "
                "s = TCPStore('127.0.0.1', int(sys.argv[1]), timeout=timedelta(seconds=10)); "
                "s.set('from-child', b'1'); s.close()")
        proc = subprocess.run([sys.executable, "-c", code, str(server.port)], env=_child_env(),
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        assert server.get("from-child") == b"1"
    finally:
        server.close()


def test_secret_file_is_private_and_goes_with_the_server(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    _no_token_env(monkeypatch)
    monkeypatch.setenv("RINGLET_RUNTIME_DIR", str(tmp_path / "rt"))
    stale = None
    server = _master()
    try:
        sid = server._server.secret_id
        path = tmp_path / "rt" / f"store-{sid}.secret"
        assert oct((tmp_path / "rt").stat().st_mode & 0o777) == "0o700"
        assert oct(path.stat().st_mode & 0o777) == "0o600"
        # a master that died left its secret behind: the next master of this user removes it
        dead = subprocess.Popen(["true"])
        dead.wait()
        stale = tmp_path / "rt" / f"store-{dead.pid}-0123456789abcdef.secret"
        stale.write_bytes(b"x")
        second = _master()
        second.close()
        assert not stale.exists()
    finally:
        server.close()
    assert not path.exists()


def test_squatted_secret_directory_is_refused(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    _no_token_env(monkeypatch)
    squat = tmp_path / "squat"
    squat.mkdir(mode=0o755)
    squat.chmod(0o755)
    monkeypatch.setenv("RINGLET_RUNTIME_DIR", str(squat))
    with pytest.raises(DistStoreError, match="expected a directory owned by uid .* with mode 0700"):
        _master()


def test_process_without_the_secret_is_refused(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """What another host, or a process that only reached the store's port, sees: refused at once
    with a message saying that jobs across hosts need a shared run token."""
    _no_token_env(monkeypatch)
    server = _master()
    try:
        monkeypatch.setenv("RINGLET_RUNTIME_DIR", str(tmp_path / "elsewhere"))
        started = time.monotonic()
        with pytest.raises(DistStoreError, match="bad run token.*only processes of its user on its "
                                                 "host.*RINGLET_STORE_TOKEN_FILE"):
            TCPStore("127.0.0.1", server.port, timeout=SHORT)
        assert time.monotonic() - started < 1.0
    finally:
        server.close()


def test_file_store_of_another_user_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file owned by another user")
    path = tmp_path / "store"
    path.write_bytes(b"")
    os.chown(path, 65534, 65534)
    path.chmod(0o666)
    with pytest.raises(DistStoreError, match="expected a file of this user"):
        FileStore(str(path), 2)


_AS_OTHER_USER = """
import encodings.idna, json, os, sys  # idna: imported before we lose access to the stdlib
from datetime import timedelta
from ringlet.store import TCPStore
port, secret_glob = int(sys.argv[1]), sys.argv[2]
os.setgid(65534); os.setuid(65534)          # imports done as root; from here on: user nobody
out = {}
try:
    TCPStore('127.0.0.1', port, timeout=timedelta(seconds=5))
    out['store'] = 'joined'
except Exception as e:
    out['store'] = type(e).__name__ + ': ' + str(e)
try:
    out['read'] = open(secret_glob, 'rb').read().decode()
except OSError as e:
    out['read'] = type(e).__name__
print(json.dumps(out))
"""


def test_another_user_cannot_join_the_store_or_read_its_secret(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user")
    _no_token_env(monkeypatch)
    server = _master()
    try:
        from ringlet.store._secret import secret_dir

        path = os.path.join(str(secret_dir(create=False)),
                            f"store-{server._server.secret_id}.secret")
        proc = subprocess.run([sys.executable, "-c", _AS_OTHER_USER, str(server.port), path],
                              env=_child_env(), capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got["store"].startswith("DistStoreError") and "bad run token" in got["store"], got
        assert got["read"] == "PermissionError", got
    finally:
        server.close()


# -- 2 and 3. the tcp mesh of a job started without a token, under attack during set-up ----------
def _wait_file(path: Path, procs: list[subprocess.Popen[bytes]], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            logs = [p.stderr.read().decode()[-2000:] if p.poll() is not None and p.stderr else ""
                    for p in procs]
            pytest.fail(f"{path.name} never appeared; ranks: {[p.poll() for p in procs]} {logs}")
        time.sleep(0.01)


@pytest.mark.timeout(90)
def test_tcp_setup_refuses_injection_and_survives_a_flood(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """Two ranks over tcp, started by hand without a run token.  While rank 0 waits for rank 1's
    connection, an attacker (a) cannot read the store, (b) claiming rank 1 with the right group id
    but without the secret is refused, and (c) 100 idle plus 100 garbage connections neither fail
    nor slow rank 1's set-up; the job then computes the right sum (3, not an injected value)."""
    _no_token_env(monkeypatch)
    flag = tmp_path / "go"
    server = _master()
    procs: list[subprocess.Popen[bytes]] = []
    attack: list[socket.socket] = []
    try:
        for rank in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "_security_workers.py"), "mesh", str(rank),
                 str(server.port), str(tmp_path), str(flag), "20"],
                env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE))
        _wait_file(tmp_path / "mesh0.json", procs, 60)
        mesh0 = json.loads((tmp_path / "mesh0.json").read_text())
        # (a) a process that only reached the store
        monkeypatch.setenv("RINGLET_RUNTIME_DIR", str(tmp_path / "attacker"))
        with pytest.raises(DistStoreError, match="bad run token"):
            TCPStore("127.0.0.1", server.port, timeout=SHORT)
        # (b) the injection of issue 16: handshake as rank 1 with the group id but no secret
        sock = socket.create_connection(("127.0.0.1", mesh0["port"]), timeout=5)
        attack.append(sock)
        with pytest.raises(DistNetworkError,
                           match="refused this rank's connection: a bad run token"):
            wire.connect_handshake(sock, 1, 0, 0, None, bytes.fromhex(mesh0["gid"]),
                                   time.monotonic() + 5, "rank 0")
        # (c) the flood
        for i in range(200):
            s = socket.create_connection(("127.0.0.1", mesh0["port"]), timeout=5)
            if i % 2:
                s.sendall(os.urandom(200))
            attack.append(s)
        flag.write_text("go")
        for p in procs:
            p.wait(timeout=60)
        assert ([p.returncode for p in procs]
                == [0, 0]), ([p.stderr.read().decode()[-3000:] for p in procs if p.stderr])
        res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
        assert [r["value"] for r in res] == [3.0, 3.0]
        assert res[1]["after_flag_s"] < 1.5, res   # normal set-up takes milliseconds
    finally:
        for s in attack:
            s.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate(timeout=10)
        server.close()


# -- 4. nothing left behind
# -------------------------------------------------------------------------
_EMFILE_SERVER = """
import os, resource, sys, time
from ringlet.store import TCPStore
s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, token=b't')
hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir('/proc/self/fd')) + 6, hard))
print(s.port, flush=True)
time.sleep(60)
"""


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(60)
def test_store_server_backs_off_when_out_of_file_descriptors() -> None:
    """A server that cannot accept (EMFILE) must not spin on its readable listener; once
    descriptors are free again it serves new clients."""
    proc = subprocess.Popen([sys.executable, "-c", _EMFILE_SERVER], env=_child_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    socks: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        for _ in range(30):     # more than the server may accept: the rest wait in its backlog
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        time.sleep(0.3)
        before = _cpu_seconds(proc.pid)
        time.sleep(1.0)
        used = _cpu_seconds(proc.pid) - before
        assert used < 0.3, (f"the store server used {used:.2f} s of CPU in 1 s while out of "
                            "descriptors")
        for s in socks:
            s.close()
        socks.clear()
        client = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10), token=b"t")
        client.set("after", b"1")
        assert client.get("after") == b"1"
        client.close()
    finally:
        for s in socks:
            s.close()
        proc.kill()
        proc.communicate(timeout=10)


def _fake_segment(name: str, uid: int | None = None) -> Path:
    path = Path("/dev/shm") / name
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    if uid is not None:
        os.chown(path, uid, uid)
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_segments_of_dead_creators_are_swept_and_nothing_else() -> None:
    from ringlet import _segments

    ns = _segments._pid_namespace()
    dead = _dead_pid()
    stale = _fake_segment(f"ringlet-{ns}-{dead}-{'a' * 16}")
    live = _fake_segment(f"ringlet-{ns}-{os.getpid()}-{'b' * 16}")
    other_ns = _fake_segment(f"ringlet-{ns + 1}-{dead}-{'c' * 16}")
    foreign = (_fake_segment(f"ringlet-{ns}-{dead}-{'d' * 16}", uid=65534)
               if os.geteuid() == 0 else None)
    try:
        removed = _segments.sweep_stale()
        assert stale.name in removed and not stale.exists()
        assert live.exists() and other_ns.exists()
        assert foreign is None or foreign.exists()
    finally:
        for p in (stale, live, other_ns, foreign):
            if p is not None and p.exists():
                p.unlink()


def test_a_new_shm_group_removes_a_segment_left_by_a_killed_creator() -> None:
    from ringlet import _segments

    stale = _fake_segment(f"ringlet-{_segments._pid_namespace()}-{_dead_pid()}-{'e' * 16}")
    try:
        raise_first(run_world(2, W.plain_data_round, backend="shm", timeout=60))
        assert not stale.exists()
    finally:
        if stale.exists():
            stale.unlink()


_DIE_DURING_SETUP = """
import os, signal, sys
from pathlib import Path
import ringlet.distributed as dist
from ringlet.transport import shm
out = Path(sys.argv[1])
create = shm._create_segment
def reveal(*args):
    made = create(*args)                     # (mapping, path, ...)
    (out / "segment").write_text(made[1])
    return made
def die(*args):
    # killed after rank 0 created the arena, before attaching
    os.kill(os.getpid(), signal.SIGKILL)
shm._create_segment = reveal
shm._attach_segment = die
dist.init_process_group("shm")
"""


@pytest.mark.timeout(90)
def test_rank_killed_during_setup_leaves_no_segment(tmp_path: Path) -> None:
    """Rank 1 is killed after rank 0 created the group's arena and before attaching to it; the
    launcher then kills rank 0 too.  The arena's name must not survive the launcher."""
    script = tmp_path / "job.py"
    script.write_text(_DIE_DURING_SETUP)
    proc = subprocess.run([sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", "2",
                           "--grace-period", "0.5", str(script), str(tmp_path)],
                          env=_child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "signal SIGKILL" in proc.stderr
    segment = Path((tmp_path / "segment").read_text())
    assert segment.name.startswith("ringlet-") and not segment.exists()


def test_launcher_refuses_more_workers_than_the_machine_allows(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit('must not run')\n")
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "ringlet.launcher.run",
                           "--nproc-per-node", "100000",
                           str(script)], env=_child_env(), capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "expected --nproc-per-node <= " in proc.stderr and "got 100000" in proc.stderr
    assert "Traceback" not in proc.stderr and time.monotonic() - started < 10


_FORK_FAILS = """
import errno, subprocess, sys
real = subprocess.Popen
count = [0]
class Refusing(real):
    def __init__(self, *args, **kwargs):
        count[0] += 1
        if count[0] == 2:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        super().__init__(*args, **kwargs)
subprocess.Popen = Refusing
from ringlet.launcher.run import main
main(sys.argv[1:])
"""


def test_failed_fork_is_a_clear_error_and_stops_the_started_workers(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import os, time\nopen(f'{os.environ[\"RANK\"]}.pid', "
                      "'w').write(str(os.getpid()))\ntime.sleep(60)\n")
    proc = subprocess.run([sys.executable, "-c", _FORK_FAILS, "--nproc-per-node", "3", str(script)],
                          env=_child_env(), capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "could not start the worker of rank 1 (local rank 1; 1 of 3 started)" in proc.stderr
    assert "Resource temporarily unavailable" in proc.stderr and "Traceback" not in proc.stderr
    for pidfile in tmp_path.glob("*.pid"):
        assert not _running(int(pidfile.read_text()))


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


_DETACHED_CHILDREN = """
import os, subprocess, sys, time
out = sys.argv[1]
rank = os.environ["RANK"]
sleeper = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(120)"
# a child in its own session: the worker's process group never reaches it
subprocess.Popen([sys.executable, "-c", "import os; os.setsid(); " + sleeper,
                  f"{out}/setsid{rank}"])
# a double-forked daemon: its parent exits at once, so it is orphaned while the worker still runs
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", sleeper, f"{out}/daemon{rank}"])
    os._exit(0)
os.wait()
# every descendant exists before any rank ends (rank 1 failing first must not beat rank 0's
# children to their pid files: the launcher would end them unseen)
deadline = time.time() + 20
while (not all(os.path.exists(f"{out}/{k}{r}") for k in ("setsid", "daemon") for r in "01")
       and time.time() < deadline):
    time.sleep(0.01)
sys.exit(int(sys.argv[2]) if rank == "1" else 0)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("exit_code", [0, 3])
def test_launcher_ends_every_descendant_of_its_workers(tmp_path: Path, exit_code: int) -> None:
    """Workers start a setsid() child and a double-forked daemon; whether the job succeeds or
    fails, none of them outlives the launcher."""
    script = tmp_path / "job.py"
    script.write_text(_DETACHED_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", "2",
                           "--grace-period", "1", str(script), str(tmp_path), str(exit_code)],
                          env=_child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == (1 if exit_code else 0), proc.stderr
    pids = [int(p.read_text()) for k in ("setsid", "daemon") for p in tmp_path.glob(f"{k}*")]
    assert len(pids) == 4, proc.stderr
    deadline = time.monotonic() + 3
    while any(_running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    survivors = [p for p in pids if _running(p)]
    for p in survivors:
        os.kill(p, 9)
    assert not survivors, f"descendants outlived the launcher: {survivors}"
