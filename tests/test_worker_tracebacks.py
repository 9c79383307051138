"""A user's error raised inside ringlet ends the traceback at the user's line (ringlet's frames
hidden, with a note saying how to see them), under ringlet-run; RINGLET_DEBUG=DETAIL keeps every
frame; an error raised in the user's own code is left as it is."""

from __future__ import annotations

import os
import textwrap
import traceback
from pathlib import Path

import pytest
import torch
from test_torch_backend_launch import _run

from ringlet.launcher import _worker

RINGLET_DIR = str(Path(_worker.__file__).resolve().parents[1]) + os.sep


def _frames(tb) -> list[str]:
    return [f.filename for f in traceback.extract_tb(tb)]


def _ringlet_error() -> BaseException:
    from ringlet.c10d import checks

    try:
        checks.dense(torch.ones(2).t().expand(3, 2), "all_reduce", "tensor", ("cpu",), out=True)
    except Exception as e:
        return e
    raise AssertionError("expected ringlet to refuse the argument")


def test_ringlet_frames_below_the_users_line_are_cut(monkeypatch) -> None:
    monkeypatch.delenv("RINGLET_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    exc = _ringlet_error()
    whole = _frames(exc.__traceback__)
    assert any(f.startswith(RINGLET_DIR) for f in whole)
    shown = _frames(_worker._trim_library_tail(exc, exc.__traceback__))
    assert shown and shown == [f for f in whole if not f.startswith(RINGLET_DIR)][:len(shown)]
    assert not any(f.startswith(RINGLET_DIR) for f in shown)
    assert _worker.TRIMMED_NOTE in exc.__notes__
    assert _frames(exc.__traceback__) == whole        # the exception's own traceback is kept


def test_detail_and_user_errors_keep_every_frame(monkeypatch) -> None:
    exc = _ringlet_error()
    monkeypatch.setenv("RINGLET_DEBUG", "DETAIL")
    assert _worker._trim_library_tail(exc, exc.__traceback__) is exc.__traceback__
    monkeypatch.delenv("RINGLET_DEBUG")
    try:
        raise KeyError("mine")
    except KeyError as e:
        assert _worker._trim_library_tail(e, e.__traceback__) is e.__traceback__


@pytest.mark.timeout(150)
def test_under_ringlet_run_the_user_sees_their_line_and_the_message(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent("""
        import torch
        import ringlet.distributed as dist

        dist.init_process_group()
        dist.broadcast(torch.ones(2), src=7)
    """))
    code, out, err = _run(tmp_path, ["ringlet.launcher.run", "--nproc-per-node", "2",
                                     str(script)])
    assert code != 0
    assert "dist.broadcast(torch.ones(2), src=7)" in err, err[-3000:]
    assert "expected a global rank of the group [0, 1], got 7" in err, err[-3000:]
    assert _worker.TRIMMED_NOTE in err
    assert "ringlet/c10d/" not in err, err[-3000:]
