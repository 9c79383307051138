"""Security: each attack of docs/security.md as an automated test.

1. Code execution through object collectives in restricted mode (``RINGLET_SAFE_OBJECTS=1``):
   a corpus of pickle gadgets sent by a hostile rank across real processes; none runs.
"""

from __future__ import annotations

import time
from pathlib import Path

import _security_workers as W
import pytest

from ringlet.c10d import objects
from ringlet.testing.procs import raise_first, run_world

pytestmark = pytest.mark.timeout(60)

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
def test_gadget_is_live_in_trusting_mode(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: each gadget of the corpus really runs code when decoded by a trusting receiver, so
    the restricted-mode test below proves something (the old allowlist let some of these through)."""
    monkeypatch.delenv("RINGLET_SAFE_OBJECTS", raising=False)
    sentinel = tmp_path / "pwned"
    payload, _ = W.gadgets(str(sentinel), str(tmp_path))[name]
    try:
        objects._decode(payload, 0, "control")
    except Exception:
        pass
    assert _wait_for(sentinel, 5.0), f"gadget {name} did not run even in trusting mode"


def test_gadget_corpus_refused_in_restricted_mode_in_process(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
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
        assert outcome.startswith("UnpicklingError") and "refuses the object from rank 0" in outcome, (
            name, outcome)
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

