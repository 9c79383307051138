"""Checkpoint faults: corrupt, truncated, missing and hostile files are refused on every rank before
anything is copied; a rank killed during a save, a failing rank and a full disk leave the previous
checkpoint loadable; two saves into one directory exclude each other."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import _ckpt_workers as W
import pytest
import torch

import ringlet.distributed.checkpoint as dcp
from ringlet.checkpoint._storage import DirLock
from ringlet.distributed.tensor import Shard, distribute_tensor, init_device_mesh
from ringlet.testing import RankFailure, run_threads
from ringlet.testing.procs import run_world

pytestmark = pytest.mark.timeout(90)

REPO = Path(__file__).resolve().parents[1]


def _save(rank: int, world: int, path: str, value: float) -> None:
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"w": distribute_tensor(torch.full((8, 3), value), mesh, [Shard(0)]), "s": value},
             checkpoint_id=path)


def _load(rank: int, world: int, path: str) -> tuple[float, float, float]:
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
    sd = {"w": w, "s": 0.0}
    try:
        dcp.load(sd, checkpoint_id=path)
    finally:
        untouched = float(w.to_local().abs().sum())
    return float(w.full_tensor().mean()), sd["s"], untouched


def _shards(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.suffix == ".safetensors")


def _corrupt(path: Path, how: str) -> str:
    """Damage the shard of rank 1 only (rank 0 of a 2-rank load never reads it)."""
    shard = _shards(path)[1]
    data = bytearray(shard.read_bytes())
    if how == "flip":
        data[-5] ^= 0x01
        shard.write_bytes(bytes(data))
    elif how == "truncate":
        shard.write_bytes(bytes(data[:-7]))
    elif how == "empty":
        shard.write_bytes(b"")
    elif how == "missing":
        shard.unlink()
    elif how == "symlink":
        target = path.parent / "elsewhere.bin"
        target.write_bytes(bytes(data))
        shard.unlink()
        shard.symlink_to(target)
    return shard.name


@pytest.mark.parametrize(("how", "message"), [
    ("flip", "checksum mismatch"), ("truncate", "truncated or replaced"), ("empty", "expected"),
    ("missing", "missing"), ("symlink", "is a symlink")])
def test_damaged_shard_is_refused_on_every_rank_before_copying(tmp_path, how: str,
                                                               message: str) -> None:
    path = tmp_path / "ck"
    run_threads(_save, 2, str(path), 3.0)
    name = _corrupt(path, how)
    with pytest.raises(RankFailure) as e:
        run_threads(_load, 2, str(path))
    failure = e.value.cause
    assert isinstance(failure, dcp.CheckpointException), e.value
    assert (list(failure.failures) == [1] and message in failure.failures[1]
            and name in failure.failures[1])
    if how == "flip":
        assert "tensor 'w'" in failure.failures[1]


def _check_untouched(rank: int, world: int, path: str) -> float:
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.zeros(8, 3), mesh, [Shard(0)])
    try:
        dcp.load({"w": w, "s": 0.0}, checkpoint_id=path)
    except dcp.CheckpointException:
        return float(w.to_local().abs().sum())
    raise AssertionError("load succeeded")


def test_a_failed_load_leaves_every_rank_untouched(tmp_path) -> None:
    path = tmp_path / "ck"
    run_threads(_save, 2, str(path), 3.0)
    _corrupt(path, "flip")
    assert run_threads(_check_untouched, 2, str(path)) == [0.0, 0.0]


@pytest.mark.parametrize("attack", ["traversal", "absolute", "garbage", "pickle"])
def test_hostile_metadata_is_refused(tmp_path, attack: str) -> None:
    path = tmp_path / "ck"
    run_threads(_save, 1, str(path), 3.0)
    meta_file = path / "metadata.json"
    meta = json.loads(meta_file.read_text())
    (name, info), = meta["files"].items()
    outside = tmp_path / "outside.bin"
    shutil.copy(path / name, outside)
    sentinel = tmp_path / "pwned"
    if attack in ("traversal", "absolute"):
        evil = "../outside.bin" if attack == "traversal" else str(outside)
        meta["files"] = {evil: info}
        for chunk in meta["tensors"]["w"]["chunks"]:
            chunk["file"] = evil
        meta_file.write_text(json.dumps(meta))
    elif attack == "garbage":
        meta_file.write_bytes(meta_file.read_bytes()[:50])
    else:
        import pickle

        class Evil:
            def __reduce__(self):
                return (os.system, (f"touch {sentinel}",))
        meta_file.write_bytes(pickle.dumps(Evil()))
    with pytest.raises(RankFailure) as e:
        run_threads(_load, 1, str(path))
    assert isinstance(e.value.cause, dcp.CheckpointException)
    assert "not a valid ringlet checkpoint metadata file" in str(e.value)
    assert not sentinel.exists()


def test_rank_killed_during_save_leaves_previous_checkpoint(tmp_path) -> None:
    path = str(tmp_path / "ck")
    W_ = 2
    assert all(r.ok for r in run_world(W_, W.save, path, 1.0, timeout=60))
    seed = random.randrange(1 << 30)
    # a shard is 128-145 KB: header, middle or end
    after = random.Random(seed).randrange(0, 130_000)
    results = run_world(W_, W.save, path, 2.0, timeout=60, op_timeout=5.0,
                        env={"RINGLET_CKPT_FAULT": f"rank=1;after_bytes={after};do=sigkill"})
    assert results[1].exitcode == -9, (seed, results[1])
    assert not results[0].ok and results[0].elapsed < 20, (seed, results[0])
    assert ("rank 1" in results[0].message
            or "peer" in results[0].message.lower()), (seed, results[0].message)
    loaded = run_world(W_, W.load_values, path, timeout=60)
    assert [r.value for r in loaded] == [[1.0, 1]] * 2, (seed, [r.message for r in loaded])
    # the next save cleans up
    assert all(r.ok for r in run_world(W_, W.save, path, 3.0, timeout=60))
    assert len([p for p in os.listdir(path) if p.endswith(".safetensors")]) == 2


def test_async_save_over_processes_and_a_rank_killed_during_it(tmp_path) -> None:
    path = str(tmp_path / "ck")
    assert [r.value[0] for r in run_world(2, W.async_save, path, 1.0, timeout=60)] == ["ok", "ok"]
    results = run_world(2, W.async_save, path, 2.0, 5000, timeout=60, op_timeout=3.0)
    assert results[1].exitcode == -9, results[1]
    status, elapsed, message = results[0].value
    assert (status == "failed" and elapsed < 3.0 + 3.0
            and "did not report" in message), (results[0].value)
    assert [r.value for r in run_world(2, W.load_values, path, timeout=60)] == [[1.0, 1]] * 2


def _save_raising(rank: int, world: int, path: str) -> None:
    value = object() if rank == 1 else 1
    dcp.save({"v": value, "t": torch.ones(2)}, checkpoint_id=path)


def test_a_failing_rank_fails_the_save_everywhere_and_commits_nothing(tmp_path) -> None:
    path = str(tmp_path / "ck")
    run_threads(_save, 2, path, 1.0)
    with pytest.raises(RankFailure) as e:
        run_threads(_save_raising, 2, path)
    assert (isinstance(e.value.cause, dcp.CheckpointException)
            and list(e.value.cause.failures) == [1])
    assert "never pickle" in str(e.value)
    assert run_threads(_load, 2, path)[0][:2] == (1.0, 1.0)


def test_two_savers_into_one_directory_exclude_each_other(tmp_path) -> None:
    path = tmp_path / "ck"
    path.mkdir()
    held = DirLock(str(path))
    try:
        with pytest.raises(RankFailure, match="another save into this directory is in progress"):
            run_threads(_save, 2, str(path), 1.0)
    finally:
        held.release()
    run_threads(_save, 2, str(path), 1.0)


FULL_DISK = """
import sys, torch
sys.path.insert(0, {tests!r})
import _ckpt_workers as W
from ringlet.testing import run_threads, RankFailure
path = {path!r}
run_threads(W.save, 2, path, 1.0)            # fits in the tiny disk
try:
    run_threads(W.big_save, 2, path)         # does not
except RankFailure as e:
    print("FAILED", type(e.cause).__name__, sorted(e.cause.failures),
          str(e.cause).replace("\\n", " | "))
print("LOADED", run_threads(W.load_values, 2, path))
"""


def test_full_disk_fails_cleanly_and_keeps_the_previous_checkpoint(tmp_path) -> None:
    if shutil.which("unshare") is None:
        pytest.skip("unshare is not installed")
    disk = tmp_path / "disk"
    disk.mkdir()
    script = tmp_path / "full.py"
    script.write_text(textwrap.dedent(FULL_DISK.format(tests=str(REPO / "tests"),
                                                       path=str(disk / "ck"))))
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {disk}"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"private mounts are not permitted here: {probe.stderr.strip()}")
    cmd = f"mount -t tmpfs -o size=1m tmpfs {disk} && exec {sys.executable} {script}"
    out = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    failed = next(line for line in out.stdout.splitlines() if line.startswith("FAILED"))
    assert ("CheckpointException" in failed and "errno 28" in failed
            and "No space left" in failed), failed
    assert "LOADED [[1.0, 1], [1.0, 1]]" in out.stdout, out.stdout
