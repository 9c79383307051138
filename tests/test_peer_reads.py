"""The all-reduce of ordinary tensors that reads the peers' memory (process_vm_readv): bits equal
to the slot path's, every mix with ranks that do not read, a peer dying inside it, and the
reader's own checks (probe, bad addresses, dead processes) without any group."""

from __future__ import annotations

import os
import subprocess
import sys

import _peer_read_workers as pw
import pytest
import torch
from _workers import survivors_failed_fast

from ringlet.errors import DistBackendError
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport.arena_cma import PeerReader, Token, _read
from ringlet.transport.base import OpContext

ENV = {"RINGLET_SHM_PEER_READ_BYTES": "4096"}


def _reader_of_self() -> PeerReader:
    """A reader whose 'peer' (rank 1) is this very process: reads are then local copies."""
    own = Token()
    return PeerReader(0, [os.getpid(), os.getpid()], [0, own.address], [0, own.value], own)


def test_reads_copy_bytes_and_bad_addresses_are_errors_not_crashes() -> None:
    src = torch.arange(1000, dtype=torch.float32)
    dst = torch.zeros(1000)
    reader = _reader_of_self()
    assert reader.usable(), reader.why_not
    reader.read(1, src.data_ptr(), dst.data_ptr(), 4000)
    assert torch.equal(src, dst)
    with pytest.raises(OSError) as bad:
        reader.read(1, 4096, dst.data_ptr(), 4000)           # unmapped in the "peer"
    assert bad.value.errno == 14                             # EFAULT
    ctx = OpContext(op="all_reduce", group="g", rank=0, world_size=2, seq=3, timeout=5.0)
    with pytest.raises(DistBackendError, match=r"could not read rank 1's tensor .*address 0x1000"):
        _read(reader, 1, 4096, dst, ctx)


def test_the_probe_refuses_wrong_tokens_and_gone_processes() -> None:
    own, other = Token(), Token()
    pids = [os.getpid(), os.getpid()]
    wrong = PeerReader(0, pids, [0, other.address], [0, own.value], own)
    assert not wrong.usable() and "not rank 1's process" in wrong.why_not
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead = PeerReader(0, [os.getpid(), int(gone.stdout)], [0, own.address], [0, own.value], own)
    assert not dead.usable() and "rank 1" in dead.why_not
    unpublished = PeerReader(0, pids, [0, 0], [0, 0], own)
    assert not unpublished.usable() and "no token" in unpublished.why_not


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_peer_reads_match_the_slot_path_and_mix_with_every_other_kind_of_rank(n: int) -> None:
    for got in raise_first(run_world(n, pw.parity, env=ENV, timeout=90)):
        assert got["why_not"] == "", got
        assert got["checked"] == 14 and got["peer_reads"] == 14, got
    assert raise_first(run_world(n, pw.mixed, env=ENV, timeout=90)) == [3 ** n] * n


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_a_peer_failing_inside_a_peer_read_all_reduce_fails_the_others_fast(how: str) -> None:
    res = run_world(3, pw.peer_dies, how, env=ENV, op_timeout=10.0, timeout=60)
    survivors_failed_fast(res, (0, 2), dead=1, within=3.0)
    if how == "kill":
        assert res[1].exitcode != 0
    else:
        assert res[1].value["error"].startswith("KeyboardInterrupt"), res[1].value
