"""ringlet-run before any worker starts: the entry point is checked first (a misspelled script,
module or command is refused at once), and the log folder cannot stop it with a traceback."""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path

import pytest
from test_launcher import _launch

from ringlet._heartbeat import DONE
from ringlet._heartbeat import ENV as HEARTBEAT_ENV
from ringlet.launcher import LaunchConfig, _worker
from ringlet.launcher._job import make_log_root
from ringlet.launcher._preflight import check_entrypoint
from ringlet.launcher._watch import Heartbeats


def test_entrypoint_checks_name_what_is_missing(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    (tmp_path / "mymod.py").write_text("")
    (tmp_path / "folder").mkdir()

    def why(entry: str, **kw: bool) -> str | None:
        return check_entrypoint(LaunchConfig(entrypoint=entry, **kw))

    assert why("train.py") is None and why("mymod", module=True) is None
    assert why("mymod.sub", module=True) is None    # the parent is found without importing it
    assert "did you mean './train.py'" in str(why("trian.py"))
    assert "expected a file" in str(why("folder"))
    assert "no module named 'nosuchmod'" in str(why("nosuchmod.train", module=True))
    assert why("sh", no_python=True) is None
    assert "not found on PATH" in str(why("no-such-command-xyz", no_python=True))
    assert "expected an executable file" in str(why("./train.py", no_python=True))
    if os.geteuid() != 0:   # root reads anything
        (tmp_path / "secret.py").write_text("")
        (tmp_path / "secret.py").chmod(0)
        assert "expected a readable file" in str(why("secret.py"))


@pytest.mark.timeout(60)
def test_misspelled_script_is_refused_before_workers_start(tmp_path: Path) -> None:
    (tmp_path / "train.py").write_text("open('started', 'w').close()\n")
    code, _, err, _ = _launch(tmp_path, "--nproc-per-node", "2", "trian.py")
    assert code == 2, err
    assert "error: training script 'trian.py' not found" in err and "train.py" in err
    assert "Traceback" not in err and not (tmp_path / "started").exists()
    code, _, err, _ = _launch(tmp_path, "-m", "trian")
    assert code == 2 and "no module named 'trian'" in err, err


@pytest.mark.timeout(60)
def test_worker_bootstrap_imports_neither_torch_nor_ringlet(tmp_path: Path) -> None:
    # The bootstrap runs by its path: a script that needs no torch starts without importing it.
    (tmp_path / "probe.py").write_text(
        "import sys, json\n"
        "json.dump([sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'ringlet')),"
        " sys.path[0]], open('seen.json', 'w'))\n")
    code, _, err, _ = _launch(tmp_path, "probe.py")
    assert code == 0, err
    loaded, first = json.loads((tmp_path / "seen.json").read_text())
    assert loaded == [] and first == str(tmp_path)


def test_a_worker_whose_code_is_over_is_no_longer_watched(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # Exiting (tearing torch down) can outlast --heartbeat-timeout on a busy machine: the
    # bootstrap marks the counter DONE when the user's code returns or raises.
    beats = Heartbeats([str(tmp_path / "hb")], timeout=1.0)
    beats.create()
    try:
        beats.started()
        monkeypatch.setenv(HEARTBEAT_ENV, str(tmp_path / "hb"))
        with open(tmp_path / "hb", "r+b") as f:
            f.write(struct.pack("=q", 5))           # it beat: watched from now on
        assert beats.silent(time.monotonic()) == {}
        assert list(beats.silent(time.monotonic() + 2.0)) == [0]
        _worker._heartbeat_done()
        assert struct.unpack("=q", (tmp_path / "hb").read_bytes())[0] == DONE
        now = time.monotonic()
        assert beats.silent(now + 10.0) == {} and beats.silent(now + 20.0) == {}   # never again
    finally:
        beats.close()


def test_log_root_skips_a_dangling_symlink(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "job").symlink_to(tmp_path / "gone")
    config = LaunchConfig(entrypoint="t.py", log_dir=str(logs))
    root = make_log_root(config, "job")
    assert root == str(logs / "job-2") and os.path.isdir(root)
    assert not (tmp_path / "gone").exists()   # the link was not followed


@pytest.mark.timeout(60)
def test_unusable_log_dir_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("open('started', 'w').close()\n")
    (tmp_path / "logs").write_text("a file, not a folder")
    code, _, err, _ = _launch(tmp_path, "--log-dir", "logs", "--rdzv-id", "job", "t.py")
    assert code == 2, err
    assert "error: --log-dir 'logs': expected a folder where this run's logs can be created" in err
    assert "Traceback" not in err and not (tmp_path / "started").exists()
