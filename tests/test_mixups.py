"""A program for one launcher started by the other (issue 27, "Mistakes a new user makes"): a
script for ringlet under torchrun, or for torch under ringlet-run, is told so, instead of failing
with a bare "address in use" or torch's C++ store errors.  torch.distributed is the oracle here."""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as tdist

from ringlet.errors import DistNetworkError
from ringlet.launcher._job import failure_summary
from ringlet.launcher._supervisor import WorkerFailure
from ringlet.store import TCPStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def torchrun_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torchrun puts in its workers' environment (and ringlet-run does not)."""
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.delenv("RINGLET_AGENT_STORE", raising=False)


def test_ringlet_client_of_torchruns_store_is_told_at_once(torchrun_env: None) -> None:
    agent = tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30),
                           wait_for_workers=False)
    started = time.monotonic()
    with pytest.raises(DistNetworkError, match="started by torchrun .* serves torch's own "
                                               "TCPStore") as info:
        TCPStore("127.0.0.1", agent.port, timeout=timedelta(seconds=30))
    assert time.monotonic() - started < 20          # not the whole 30 s connect timeout
    assert f"127.0.0.1:{agent.port}" in str(info.value) and "ringlet-run" in str(info.value)
    del agent


def test_ringlet_master_on_torchruns_port_names_torchrun(torchrun_env: None) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(DistNetworkError, match="EADDRINUSE.*started by torchrun"):
            TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=5))


def test_without_torchrun_there_is_no_torch_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(DistNetworkError) as info:
            TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    assert "torchrun" not in str(info.value)


def test_torch_client_of_a_ringlet_store_is_named(caplog: pytest.LogCaptureFixture) -> None:
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=5))
    try:
        with caplog.at_level(logging.WARNING, logger="ringlet.store"), \
                pytest.raises(Exception):  # noqa: B017 - torch's own error; the log is checked
            tdist.TCPStore("127.0.0.1", server.port, 2, False, timeout=timedelta(seconds=2))
        said = [r.getMessage() for r in caplog.records if r.name == "ringlet.store"]
        assert len(said) == 1, said                  # once, however often torch retries
        assert "a torch.distributed client connected" in said[0] and "torchrun" in said[0]
        server.set("still", b"usable")
        assert server.get("still") == b"usable"
    finally:
        server.close()


def test_summary_of_a_torch_script_under_ringlet_run_says_so() -> None:
    tb = ('  File "/x/torch/distributed/rendezvous.py", line 199, in _create_c10d_store\n'
          "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
          "local network address. port: 4, useIpv6: false, code: -98, name: EADDRINUSE\n")
    first = WorkerFailure(rank=0, local_rank=0, pid=7, returncode=1, timestamp=1.0,
                          error={"traceback": tb})
    text = failure_summary(first, [], 1, "rid")
    assert "hint: the script uses torch.distributed" in text and "torchrun" in text
    assert "ringlet-run --torch-backend" in text
    plain = WorkerFailure(rank=0, local_rank=0, pid=7, returncode=1, timestamp=1.0,
                          error={"traceback": "OSError: EADDRINUSE\n"})
    assert "hint" not in failure_summary(plain, [], 1, "rid")
