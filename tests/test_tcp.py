"""The tcp transport on loopback: planning and wire units, the handshake, every collective against a
local reference (2 and 3 ranks), bit-equality with shm on random floats, and faults
(docs/reliability.md, rows C1, C3, C4, C5, C6, S6): dead, stopped and departed peers,
mismatches, wrong tokens."""

from __future__ import annotations

import socket
import threading
import time

import _cases
import _tcp_workers
import _workers
import pytest
import torch

from ringlet.errors import DistNetworkError
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport.arena import Arena, ArenaLayout, usable_cpus
from ringlet.transport.base import split_blocks
from ringlet.transport.hierarchical import HostPlan, plan_hosts, same_kernel
from ringlet.transport.reduce import RedOpType, reduction
from ringlet.transport.selection import parse_backend as _parse_backend
from ringlet.transport.tcp import choose_address, wire
from ringlet.transport.tcp.algos import Algorithms, order_free

T = 2.0


# ---------------------------------------------------------------- pure units


@pytest.mark.timeout(30)
def test_backend_names() -> None:
    assert _parse_backend(None) == "auto"
    assert _parse_backend("tcp") == "tcp"
    assert _parse_backend("gloo") == "auto"                 # text-substituted torch scripts
    assert _parse_backend("cpu:gloo,cuda:nccl") == "auto,cuda:nccl"    # CUDA tensors: torch's NCCL
    assert _parse_backend("cpu:shm,cuda:nccl") == "shm,cuda:nccl"
    assert _parse_backend("cpu:tcp,cuda:torch:nccl") == "tcp,cuda:nccl"
    assert _parse_backend("cuda:nccl") == "auto,cuda:nccl"
    assert _parse_backend("cpu:gloo") == "auto"
    assert _parse_backend("torch:gloo") == "torch:gloo"
    assert _parse_backend("cpu:torch:gloo,cuda:torch:nccl") == "torch:gloo,nccl"
    assert _parse_backend("cpu:torch:gloo,cuda:nccl") == "torch:gloo,nccl"
    with pytest.raises(ValueError, match="cuda: expected 'nccl'"):
        _parse_backend("cpu:shm,cuda:gloo")
    assert _parse_backend("CPU:TCP") == "tcp"
    assert _parse_backend("nccl") == "auto,cuda:nccl"      # CPU tensors on auto (docs/gpu.md)
    with pytest.raises(ValueError, match="expected one of"):
        _parse_backend("ucc")
    with pytest.raises(ValueError, match="device:backend"):
        _parse_backend("gpu:tcp,cpu:shm")


@pytest.mark.timeout(30)
def test_plans_blocks_and_order() -> None:
    p = plan_hosts(["a", "a", "b", "b"], 2)
    assert p == HostPlan(((0, 1), (2, 3)), 1, 0)
    assert p.uniform and p.contiguous and p.leaders == [0, 2] and p.column(1) == [1, 3]
    q = plan_hosts(["a", "b", "a", "b"], 3)
    assert q.hosts == ((0, 2), (1, 3)) and not q.contiguous and q.local == 1
    assert not plan_hosts(["a", "a", "a", "b"], 0).uniform
    assert split_blocks(10, 3) == [(0, 4), (4, 3), (7, 3)]
    assert split_blocks(2, 4) == [(0, 1), (1, 1), (2, 0), (2, 0)]
    assert order_free(RedOpType.SUM, torch.float32, 2)
    assert not order_free(RedOpType.SUM, torch.float32, 3)
    assert order_free(RedOpType.SUM, torch.int64, 5) and order_free(RedOpType.BXOR, torch.int8, 3)
    assert not order_free(RedOpType.MAX, torch.bfloat16, 3)


@pytest.mark.timeout(30)
def test_simulated_hosts_on_one_kernel_share_its_cpus() -> None:
    """Shared-memory waits spin only when every rank on this kernel has a CPU: network namespaces
    posing as hosts share the machine's cores, so their ranks count together."""
    keys = ["h/4026531840/1b2c3d4e", "h/4026531840/1b2c3d4e", "h/4026532001/1b2c3d4e",
            "h/4026532001/1b2c3d4e", "other/4026531840/99aa77ff"]
    assert [same_kernel(keys, r) for r in range(5)] == [4, 4, 4, 4, 1]
    # unknown boot id: only the host key counts
    assert same_kernel(["a/1/?", "b/1/?"], 0) == 1
    layout = ArenaLayout(2, 4096, 4096)
    arena = Arena(bytearray(layout.total), layout, 0, alive=lambda r: True, describe_peer=str)
    arena.share_cpus(2 * usable_cpus())
    assert not arena.spinner.allowed
    arena.share_cpus(1)
    assert arena.spinner.allowed


@pytest.mark.timeout(30)
def test_frame_header_and_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = wire.header(wire.DATA, 7, 123, 45, 3, 1 << 40)
    assert len(raw) == wire.HEADER.size == 40
    assert wire.parse_header(raw) == (wire.FRAME_MAGIC, wire.DATA, 7, 123, 45, 3, 1 << 40)
    assert wire.route_source("127.0.0.1") == "127.0.0.1"
    assert wire.interface_address("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="RINGLET_IFNAME"):
        wire.interface_address("nosuchif0")
    monkeypatch.setenv("RINGLET_IFNAME", "lo")
    assert choose_address(None) == "127.0.0.1"
    monkeypatch.delenv("RINGLET_IFNAME")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert choose_address(None) == "127.0.0.1"


def _handshake(token_a: bytes | None, token_c: bytes | None, claim: int = 1,
               expected_ip: str = "127.0.0.1") -> tuple[object, object]:
    """One acceptor (rank 0) and one connector (claiming ``claim``) over loopback."""
    results: dict[str, object] = {}
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def accept() -> None:
            sock, _ = srv.accept()
            with sock:
                try:
                    results["a"] = wire.accept_handshake(sock, 0, token_a, b"gid",
                                                         {(1, 0): expected_ip},
                                                         time.monotonic() + 5)
                except Exception as e:
                    results["a"] = e
        t = threading.Thread(target=accept)
        t.start()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            try:
                wire.connect_handshake(c, claim, 0, 0, token_c, b"gid",
                                       time.monotonic() + 5, "test")
                results["c"] = "ok"
            except Exception as e:
                results["c"] = e
        t.join(10)
    return results["a"], results["c"]


@pytest.mark.timeout(30)
def test_handshake_checks_token_rank_and_address() -> None:
    assert _handshake(b"tok", b"tok") == ((1, 0), "ok")
    assert _handshake(None, None) == ((1, 0), "ok")
    a, c = _handshake(b"tok", b"other")
    assert isinstance(a, DistNetworkError) and "bad run token" in str(a)
    assert (isinstance(c, DistNetworkError) and "refused" in str(c)
            and "RINGLET_STORE_TOKEN" in str(c))
    a, c = _handshake(b"tok", b"tok", claim=5)
    assert "a rank it did not expect" in str(a) and "claiming rank 5" in str(a)
    a, c = _handshake(b"tok", b"tok", expected_ip="10.9.9.9")   # not the address rank 1 published
    assert isinstance(a, DistNetworkError) and isinstance(c, DistNetworkError)


@pytest.mark.timeout(30)
def test_stranger_bytes_are_refused_without_allocating() -> None:
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]
        out: list[object] = []

        def accept() -> None:
            sock, _ = srv.accept()
            with sock:
                try:
                    wire.accept_handshake(sock, 0, b"t", b"g", {(1, 0): "127.0.0.1"},
                                          time.monotonic() + 2)
                except Exception as e:
                    out.append(e)
        t = threading.Thread(target=accept)
        t.start()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(b"GET / HTTP/1.1\r\n" + b"x" * 100)
            t.join(10)
            assert c.recv(1 << 16) != b""      # the acceptor's hello; then it closes on us
    assert out and "not a ringlet tcp peer" in str(out[0])


@pytest.mark.timeout(30)
def test_fold_order_is_host_major_across_hosts() -> None:
    xs = [torch.tensor([1e8, 1.0, -1e8], dtype=torch.float32) * (r + 1) + r for r in range(4)]
    algos = Algorithms(None, 0, 4, ["a", "a", "b", "b"])  # type: ignore[arg-type]
    red = reduction(RedOpType.SUM, None, torch.float32, 4)
    groups = algos.host_groups([0, 1, 2, 3])
    out = torch.empty(3)
    red.fold_(out, xs, groups)
    assert torch.equal(out, (xs[0] + xs[1]) + (xs[2] + xs[3]))
    assert algos.host_groups([0, 2]) is None                 # a column: one rank per host
    assert Algorithms(None, 0, 4, ["a"] * 4).host_groups([0, 1, 2, 3]) is None  # type: ignore[arg-type]
    red.fold_(xs[1], xs, groups)                               # out may alias a part
    assert torch.equal(xs[1], out)


@pytest.mark.timeout(120)
def test_hierarchical_transport_equals_flat_on_made_up_hosts() -> None:
    """4 ranks on loopback posing as 2 hosts x 2, contiguous and interleaved."""
    layouts = [["a", "a", "b", "b"], ["a", "b", "a", "b"]]
    for bad in raise_first(run_world(4, _tcp_workers.hier_fake_hosts, layouts, backend="tcp",
                                     timeout=100)):
        assert bad == [], bad


@pytest.mark.timeout(60)
def test_collectives_over_a_subset_of_the_group() -> None:
    for bad in raise_first(run_world(3, _tcp_workers.subset_collectives, backend="tcp",
                                     timeout=50)):
        assert bad == [], bad


# ---------------------------------------------------------------- every collective, processes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_every_collective_over_tcp(n: int) -> None:
    for count, failures in raise_first(run_world(n, _cases.run_all, backend="tcp", timeout=100)):
        assert not failures, "\n".join(failures[:20])
        assert count > 600
    assert (raise_first(run_world(n, _tcp_workers.backend_name, backend="auto", timeout=30))
            == ["shm"] * n)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", ["0", "1"])   # "1": [Note: tcp I/O overlap] (8 MiB: served)
def test_one_connection_per_pair_carries_collectives_and_messages_in_any_order(
        overlap: str) -> None:
    res = raise_first(run_world(3, _tcp_workers.shared_connection, backend="tcp", timeout=100,
                                op_timeout=20, env={"RINGLET_TCP_OVERLAP": overlap}))
    for r, got in enumerate(res):
        assert got["sockets_added"] == 2, (r, got)            # one per peer, 3 ranks
        assert (got["a_sum"] and got["b_sum"] and got["c_sum"] and got["d_sums"]
                and got["small_ok"]), (r, got)
        if r < 2:
            assert got["d_msg"], (r, got)
    assert res[1]["a_msg"] and res[1]["b_msg"]
    assert res[0]["c_src"] == (2, True)


@pytest.mark.timeout(60)
def test_receive_from_a_peer_that_dies_fails_within_a_second() -> None:
    res = run_world(2, _tcp_workers.recv_from_a_peer_that_dies, backend="tcp",
                    op_timeout=30.0, timeout=40)
    etype, msg, elapsed = res[0].value
    assert etype == "PeerFailureError" and "rank 1" in msg and "died" in msg, (etype, msg)
    assert elapsed < 1.5, elapsed


@pytest.mark.timeout(60)
def test_receive_from_any_rank_fails_soon_when_every_peer_left() -> None:
    etype, msg, took = raise_first(run_world(3, _tcp_workers.any_source_after_peers_left,
                                             backend="tcp", timeout=50))[0]
    assert (etype == "DistBackendError" and "no rank is left" in msg
            and took < 5.0), (etype, msg, took)


@pytest.mark.timeout(60)
def test_destroying_a_group_ends_its_pending_receives() -> None:
    etype, msg, took, threads_gone = raise_first(run_world(2,
                                                           _tcp_workers.destroy_with_pending_irecv,
                                                           backend="tcp", timeout=50))[0]
    assert etype == "GroupAbortedError" and "destroyed" in msg, (etype, msg)
    assert took < 5.0 and threads_gone, (took, threads_gone)


@pytest.mark.timeout(120)
def test_random_floats_bit_identical_to_shm_with_tiny_chunks() -> None:
    """3 ranks: floating-point results equal shm's bit for bit (same rank order), with 4 KiB
    pipelining chunks so that every large path runs dozens of chunks."""
    sizes = (7, 20_000, 150_001)
    shm = raise_first(run_world(3, _tcp_workers.differential, sizes, backend="shm", timeout=100))
    tcp = raise_first(run_world(3, _tcp_workers.differential, sizes, backend="tcp", timeout=100,
                                env={"RINGLET_TCP_CHUNK_BYTES": "4096"}))
    for r in range(3):
        diff = [k for k in shm[r] if shm[r][k] != tcp[r].get(k)]
        assert not diff and len(shm[r]) == len(tcp[r]), diff[:10]


# ---------------------------------------------------------------- faults


@pytest.mark.timeout(90)
def test_mismatches_timeouts_and_tokens_each_poison_only_their_group() -> None:
    res = raise_first(run_world(2, _tcp_workers.scenarios, T, backend="tcp", timeout=60,
                                op_timeout=10))
    for r in range(2):
        got = res[r]
        assert got["world"][0] == "ok"
        for name in ("shape", "dtype"):
            assert got[name][0] == "CollectiveMismatchError", (r, name, got[name])
            assert "ranks called different collectives" in got[name][1]
            assert "rank 0: all_reduce" in got[name][1] and "rank 1: all_reduce" in got[name][1]
        assert got["op"][0] in ("CollectiveMismatchError", "GroupAbortedError"), got["op"]
        assert "broadcast" in got["op"][1] and "all_reduce" in got["op"][1], got["op"]
        assert (got["token"][0] == "DistNetworkError"
                and "bad run token" in got["token"][1]), got["token"]
    assert res[1]["p2p"][0] == "CollectiveMismatchError"
    assert ("sent float32 data of 4 elements (16 bytes) with tag 7, but rank 1 expected float32 of "
            "shape [3] (12 bytes)") in res[1]["p2p"][1]
    # the sender learns it from the abort, as the receiver's class (also a GroupAbortedError)
    assert res[0]["p2p"][0] in ("PeerFailureError", "CollectiveMismatchError"), res[0]["p2p"]
    etype, msg, elapsed = res[0]["skip"]
    assert etype == "CollectiveTimeoutError" and "ranks [1]" in msg and "127.0.0.1" in msg, msg
    assert 0.9 * T <= elapsed <= T + 3.0, elapsed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sigkill", "exit1"])
def test_peer_death_reaches_every_survivor_within_a_second(mode: str) -> None:
    env = {"RINGLET_FAULT": f"rank=1;at=collective:seq=5;do={mode}"}
    res = {r.rank: r for r in run_world(3, _workers.timed_until_error, 50, backend="tcp",
                                        op_timeout=10.0, env=env, timeout=40)}
    for r in (0, 2):
        etype, msg, elapsed = res[r].value
        assert etype in ("PeerFailureError", "GroupAbortedError"), (r, etype, msg)
        assert "rank 1" in msg and "pid" in msg and "all_reduce #5" in msg and "died" in msg, msg
        assert elapsed < 1.0, f"rank {r} took {elapsed:.2f} s to notice"
        assert "next call: GroupAbortedError" in msg


@pytest.mark.timeout(60)
def test_stopped_peer_times_out_at_the_deadline_and_departed_peer_is_named_at_once() -> None:
    env = {"RINGLET_FAULT": "rank=1;at=collective:seq=3;do=sigstop"}
    res = {r.rank: r for r in run_world(2, _workers.timed_until_error, 10, backend="tcp",
                                        op_timeout=T, env=env, timeout=T + 5)}
    etype, msg, elapsed = res[0].value
    assert etype == "CollectiveTimeoutError" and "ranks [1]" in msg and "pid" in msg, msg
    assert 0.9 * T <= elapsed <= T + 3.0
    assert res[1].exc_type == "hung"
    t0 = time.monotonic()
    res = {r.rank: r for r in run_world(2, _workers.skip_on_rank, 1, 0.0, backend="tcp",
                                        op_timeout=10.0, timeout=30)}
    assert time.monotonic() - t0 < 8.0
    assert (res[0].exc_type == "PeerFailureError"
            and "left the group" in res[0].message), (res[0].message)


@pytest.mark.timeout(60)
def test_abort_from_another_thread_wakes_the_wait_and_reaches_the_peer() -> None:
    res = raise_first(run_world(2, _tcp_workers.abort_from_thread, backend="tcp", op_timeout=10.0,
                                timeout=30))
    etype, msg, elapsed = res[0]
    assert etype == "GroupAbortedError" and "stopped by the test" in msg and elapsed < 2.0, res[0]
    etype, msg, elapsed = res[1]
    assert (etype == "GroupAbortedError" and "aborted by rank 0" in msg
            and "stopped by the test" in msg)
