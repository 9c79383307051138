"""Checkpoints: pure planning and metadata, one-process round trips, resharding N -> M on rank
threads (bit-exact), keys, async_save, single-file export and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

import ringlet.distributed.checkpoint as dcp
from ringlet.checkpoint._flatten import decode_value, encode_value, flatten, replace_leaves
from ringlet.checkpoint._geometry import Box
from ringlet.checkpoint._metadata import Metadata
from ringlet.checkpoint._planner import plan_reads, plan_save
from ringlet.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp
from ringlet.distributed.tensor import (
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from ringlet.testing import RankFailure, run_threads

pytestmark = pytest.mark.timeout(60)

FULL = torch.arange(7 * 5, dtype=torch.float32).reshape(7, 5) * 1.5   # uneven on 2, 3 and 4 ranks


# ---------------------------------------------------------------- pure parts

def test_plain_values_round_trip_and_refusals() -> None:
    for v in [None, True, 3, -2.5, float("inf"), "x", b"\x00\xff", {}, [], (), torch.Size([2, 3])]:
        back = decode_value(json.loads(json.dumps(encode_value(v))))
        assert back == v and type(back) is type(v)
    assert str(decode_value(encode_value(float("nan")))) == "nan"
    with pytest.raises(TypeError,
                       match=r"state_dict\['k'\]: expected a tensor or a plain value.*never "
                             r"pickle"):
        encode_value(object(), "k")
    with pytest.raises(ValueError, match="both flatten to the key 'a.b'"):
        flatten({"a": {"b": 1}, "a.b": 2})
    sd = {"opt": {"groups": [{"betas": (0.9, 0.99), "lr": 1}]}}
    replace_leaves(sd, {("opt", "groups", 0, "betas", 1): 0.5, ("opt", "groups", 0, "lr"): 2})
    assert sd == {"opt": {"groups": [{"betas": (0.9, 0.5), "lr": 2}]}}


def _payload(tensors: list, values: list | None = None) -> dict:
    return {"tensors": tensors, "values": values or []}


def test_plan_writes_replicated_boxes_once_and_balances() -> None:
    rep = [["a", ["a"], "float32", [4], [0], [4]], ["b", ["b"], "float32", [8], [0], [8]],
           ["c", ["c"], "float32", [2], [0], [2]]]
    plan = plan_save([_payload(rep, [["v", ["v"], 1]]), _payload(rep, [["v", ["v"], 2]])])
    written = [kb for r in (0, 1) for kb in plan.writes[r]]
    assert sorted(k for k, _ in written) == ["a", "b", "c"]            # each once
    assert [k for k, _ in plan.writes[0]] == ["b"] and [k for k, _ in plan.writes[1]] == ["a", "c"]
    assert plan.values["v"] == (("v",), 1)                                # the lowest rank's value
    with pytest.raises(ValueError, match=r"rank 0 has float32\[4\], rank 1 has float32\[5\]"):
        plan_save([_payload([["a", ["a"], "float32", [4], [0], [4]]]),
                   _payload([["a", ["a"], "float32", [5], [0], [5]]])])
    with pytest.raises(ValueError, match="overlapping pieces"):
        plan_save([_payload([["a", ["a"], "float32", [4], [0], [3]]]),
                   _payload([["a", ["a"], "float32", [4], [1], [3]]])])
    with pytest.raises(ValueError, match="hold 2 of its 4 elements"):
        plan_save([_payload([["a", ["a"], "float32", [4], [0], [2]]])])


def _meta(chunks: list[dict], files: dict | None = None, shape: list | None = None) -> bytes:
    return json.dumps({"format": "ringlet-checkpoint", "version": 1, "save_id": "ab",
                       "world_size": 1, "checksum": {"algorithm": "crc32", "block_bytes": 1 << 20},
                       "files": files or {"shard-a": {"bytes": 1000}},
                       "tensors": {"w": {"path": ["w"], "dtype": "float32",
                                         "shape": shape or [4, 4],
                                         "chunks": chunks}}, "values": {}}).encode()


def _chunk(offsets: list, sizes: list, file: str = "shard-a", begin: int = 0) -> dict:
    n = 4 * sizes[0] * sizes[1]
    return {"offsets": offsets, "sizes": sizes, "file": file, "begin": begin, "end": begin + n,
            "crc32": [0]}


def test_metadata_parser_refuses_bad_or_hostile_files() -> None:
    ok = Metadata.from_json_bytes(_meta([_chunk([0, 0], [2, 4]), _chunk([2, 0], [2, 4], begin=32)]))
    assert ok.tensors["w"].shape == (4, 4)
    bad = {
        "plain file name": _meta([_chunk([0, 0], [4, 4], file="../x")], {"../x": {"bytes": 64}}),
        "plain file name(.|\n)*absolute": _meta([_chunk([0, 0], [4, 4], file="/etc/passwd")],
                                                {"/etc/passwd": {"bytes": 64}}),
        "overlap": _meta([_chunk([0, 0], [3, 4]), _chunk([2, 0], [2, 4], begin=48)]),
        "hold 8 of the 16": _meta([_chunk([0, 0], [2, 4])]),
        "does not hold": _meta([dict(_chunk([0, 0], [4, 4]), end=10)]),
        "inside shard-a": _meta([_chunk([0, 0], [4, 4], begin=990)]),
        "JSON constant NaN": _meta([_chunk([0, 0], [4, 4])]).replace(
            b'"world_size": 1', b'"world_size": NaN'),
        "not a valid": b"\x80garbage",
    }
    for what, raw in bad.items():
        with pytest.raises(ValueError, match=what.split("(")[0]):
            Metadata.from_json_bytes(raw, "m.json")


def test_plan_reads_direct_where_contiguous_else_whole_rows() -> None:
    meta = (Metadata.from_json_bytes(_meta([_chunk([0, 0], [2, 4]),
                                            _chunk([2, 0], [2, 4], begin=32)])).tensors["w"])
    ops = plan_reads(meta, Box.of([1, 0], [2, 4]))            # rows 1..2: one row from each chunk
    assert [(op.direct, op.lo, op.hi) for op in ops] == [(True, 16, 32), (True, 32, 48)]
    # a column block: whole rows, sliced later
    ops = plan_reads(meta, Box.of([0, 2], [4, 2]))
    assert ([(op.direct, op.lo, op.hi, op.first_row) for op in ops]
            == [(False, 0, 32, 0), (False, 32, 64, 0)])


# ---------------------------------------------------------------- one process

def test_one_process_round_trip_every_dtype_and_safetensors(tmp_path) -> None:
    sd = {"f": torch.randn(3, 4), "h": torch.randn(5).half(), "bf": torch.randn(2, 2).bfloat16(),
          "i": torch.arange(6).view(2, 3), "b": torch.tensor([True, False]),
          "c": torch.randn(3, dtype=torch.cfloat),
          "s": torch.tensor(7.0), "e": torch.empty(0, 3), "t": torch.randn(4, 6).t(),
          "nested": {"list": [1, "two", None, 2.5], "empty": {}, "blob": b"\x01"}, "step": 12}
    meta = dcp.save(sd, checkpoint_id=tmp_path / "ck")
    assert (meta.world_size == 1
            and set(meta.tensors) == {"f", "h", "bf", "i", "b", "c", "s", "e", "t"})
    tgt = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in sd.items()}
    tgt["nested"] = {"list": [0, "", 0, 0.0], "empty": {}, "blob": b""}
    dcp.load(tgt, checkpoint_id=tmp_path / "ck")
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(tgt[k], v) and tgt[k].dtype == v.dtype, k
    assert tgt["nested"] == sd["nested"] and tgt["step"] == 12
    safetensors = pytest.importorskip("safetensors.torch")
    shard = next(p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors")
    loaded = safetensors.load_file(str(shard))
    assert torch.equal(loaded["f@0,0"], sd["f"]) and torch.equal(loaded["bf@0,0"], sd["bf"])


def test_export_to_torch_file_and_back_and_cli(tmp_path) -> None:
    sd = {"model": {"fc.weight": torch.randn(3, 2), "fc.bias": torch.randn(3)}, "step": 4,
          "groups": [{"lr": 0.1, "params": ["fc.weight"]}]}
    dcp.save(sd, checkpoint_id=tmp_path / "ck")
    dcp_to_torch_save(tmp_path / "ck", tmp_path / "one.pt")
    back = torch.load(tmp_path / "one.pt", weights_only=True)
    assert torch.equal(back["model"]["fc.weight"], sd["model"]["fc.weight"]) and back["step"] == 4
    assert back["groups"] == [{"lr": 0.1, "params": ["fc.weight"]}]
    torch_save_to_dcp(tmp_path / "one.pt", tmp_path / "ck2")
    again = {"model": {"fc.weight": torch.zeros(3, 2), "fc.bias": torch.zeros(3)}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(again, checkpoint_id=tmp_path / "ck2")
    assert torch.equal(again["model"]["fc.bias"], sd["model"]["fc.bias"])
    cli = [sys.executable, "-m", "ringlet.distributed.checkpoint"]
    out = subprocess.run([*cli, "ls", str(tmp_path / "ck")], capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode == 0 and "model.fc.weight" in out.stdout
            and "float32" in out.stdout), out.stderr
    assert "[3, 2]" in out.stdout and "2 tensor(s), 36 bytes" in out.stdout
    ok = subprocess.run([*cli, "verify", str(tmp_path / "ck")], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), ok.stdout + ok.stderr
    shard = next(p for p in (tmp_path / "ck").iterdir() if p.suffix == ".safetensors")
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x40
    shard.write_bytes(bytes(data))
    bad = subprocess.run([*cli, "verify", str(tmp_path / "ck")], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 1 and "BAD" in bad.stdout and "model.fc.bias" in bad.stdout, bad.stdout
    if pytest.importorskip("safetensors"):
        conv = subprocess.run([*cli, "to-safetensors", str(tmp_path / "ck2"),
                               str(tmp_path / "one.st")],
                              capture_output=True, text=True, timeout=60)
        assert conv.returncode == 0, conv.stderr
        from safetensors.torch import load_file

        assert torch.equal(load_file(str(tmp_path / "one.st"))["model.fc.weight"],
                           sd["model"]["fc.weight"])


# ---------------------------------------------------------------- resharding on rank threads

LAYOUTS = {   # world size -> (mesh shape, placements) variants
    1: [((1,), [Shard(0)])],
    2: [((2,), [Shard(0)]), ((2,), [Replicate()]), ((2,), [Shard(1)])],
    3: [((3,), [Shard(1)]), ((3,), [Shard(0)])],
    4: [((2, 2), [Shard(0), Shard(1)]), ((2, 2), [Replicate(), Shard(0)]), ((4,), [Shard(0)]),
        ((2, 2), [Shard(0), Shard(0)])],
}


def _save_layout(rank: int, world: int, path: str, shape: tuple, pls: list) -> None:
    mesh = init_device_mesh("cpu", shape)
    dt = distribute_tensor(FULL, mesh, pls)
    dcp.save({"w": dt, "plain": torch.arange(5), "step": 9,
              "rng": {f"r{rank}": torch.tensor([rank])}},
             checkpoint_id=path)


def _load_layout(rank: int, world: int, path: str, shape: tuple, pls: list) -> bool:
    mesh = init_device_mesh("cpu", shape)
    dt = distribute_tensor(torch.zeros_like(FULL), mesh, pls)
    sd = {"w": dt, "plain": torch.zeros(5, dtype=torch.int64), "step": 0}
    with warnings.catch_warnings():
        # rng.r* are per-rank keys this state dict does not ask for
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=path)
    return (bool(torch.equal(dt.full_tensor(), FULL)) and sd["step"] == 9
            and sd["plain"].tolist() == list(range(5)))


@pytest.mark.parametrize(("n", "m"), [(4, 2), (2, 4), (4, 3), (3, 1), (1, 4), (2, 3)])
def test_reshard_n_to_m_bit_exact(tmp_path, n: int, m: int) -> None:
    for i, (shape, pls) in enumerate(LAYOUTS[n]):
        path = str(tmp_path / f"ck{i}")
        run_threads(_save_layout, n, path, shape, pls)
        files = sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))
        assert 1 <= len(files) <= n
        for shape2, pls2 in LAYOUTS[m]:
            assert (run_threads(_load_layout, m, path, shape2, pls2)
                    == [True] * m), (shape, pls, shape2, pls2)


def _partial_round_trip(rank: int, world: int, path: str) -> bool:
    mesh = init_device_mesh("cpu", (world,))
    part = distribute_tensor(FULL, mesh, [Replicate()]).redistribute(mesh, [Partial()])
    dcp.save({"w": part}, checkpoint_id=path)
    tgt = (distribute_tensor(torch.zeros_like(FULL), mesh,
                             [Replicate()]).redistribute(mesh, [Partial()]))
    dcp.load({"w": tgt}, checkpoint_id=path)
    return bool(torch.equal(tgt.full_tensor(), FULL))


def test_partial_dtensors_are_reduced_on_save_and_partitioned_on_load(tmp_path) -> None:
    assert run_threads(_partial_round_trip, 2, str(tmp_path / "ck")) == [True, True]


# ---------------------------------------------------------------- keys

def _keys(rank: int, world: int, path: str, case: str) -> object:
    if case == "save":
        return dcp.save({"a": torch.ones(2), "b": torch.ones(3), "extra": torch.ones(1)},
                        checkpoint_id=path)
    if case == "missing":
        return dcp.load({"a": torch.zeros(2), "zz": torch.zeros(1), "yy": 1}, checkpoint_id=path)
    if case == "partial":
        sd = {"a": torch.zeros(2), "zz": torch.zeros(1)}
        planner = dcp.DefaultLoadPlanner(allow_partial_load=True)
        if rank != 0:            # only rank 0 warns; warnings.catch_warnings is not thread-safe
            dcp.load(sd, checkpoint_id=path, planner=planner)
            return None
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dcp.load(sd, checkpoint_id=path, planner=planner)
        return sd["a"].tolist(), sd["zz"].tolist(), [str(w.message) for w in seen]
    return dcp.load({"a": torch.zeros(3), "b": torch.zeros(3, dtype=torch.int64)},
                    checkpoint_id=path)


def test_missing_keys_are_listed_on_every_rank_unexpected_reported(tmp_path) -> None:
    path = str(tmp_path / "ck")
    run_threads(_keys, 2, path, "save")
    with pytest.raises(RankFailure) as e:
        run_threads(_keys, 2, path, "missing")
    assert isinstance(e.value.cause, dcp.CheckpointException)
    assert "missing keys" in str(e.value) and "'zz'" in str(e.value) and "'yy'" in str(e.value)
    assert sorted(e.value.cause.failures) == [0, 1]
    a, zz, warned = run_threads(_keys, 2, path, "partial")[0]
    assert a == [1.0, 1.0] and zz == [0.0]
    assert any("'b'" in w and "'extra'" in w for w in warned), warned
    with pytest.raises(RankFailure,
                       match=r"'a': checkpoint has float32\[2\], the state dict float32\[3\]"):
        run_threads(_keys, 2, path, "mismatch")


# ---------------------------------------------------------------- async_save

def _async(rank: int, world: int, root: str) -> list:
    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.ones(6, 2), mesh, [Shard(0)])
    plain = torch.ones(3)
    first = dcp.async_save({"w": w, "p": plain, "step": 1}, checkpoint_id=f"{root}/a")
    w.to_local().add_(1)                 # training goes on: the save holds the values of the call
    plain.add_(1)
    # waits for first
    second = dcp.async_save({"w": w, "p": plain, "step": 2}, checkpoint_id=f"{root}/b")
    assert first.done()
    meta = second.result(timeout=30)
    got = []
    for sub in ("a", "b"):
        tgt = {"w": distribute_tensor(torch.zeros(6, 2), mesh, [Shard(0)]),
               "p": torch.zeros(3), "step": 0}
        dcp.load(tgt, checkpoint_id=f"{root}/{sub}")
        got.append((tgt["w"].full_tensor().unique().tolist(), tgt["p"].unique().tolist(),
                    tgt["step"]))
    return [got, meta.save_id]


def test_async_save_snapshots_at_call_time_one_in_flight(tmp_path) -> None:
    out = run_threads(_async, 2, str(tmp_path))
    assert out[0][0] == [([1.0], [1.0], 1), ([2.0], [2.0], 2)] and out[0] == out[1]


def _async_kinds(rank: int, world: int, root: str) -> list:
    from ringlet.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, async_save

    w = distribute_tensor(torch.full((4,), 3.0), init_device_mesh("cpu", (world,)), [Shard(0)])
    for kind in (AsyncCheckpointerType.PROCESS, "thread"):
        async_save({"w": w}, checkpoint_id=f"{root}/{kind}",
                   async_checkpointer_type=kind).result(timeout=30)
    with pytest.raises(ValueError, match="async_checkpointer_type: expected an Async"):
        async_save({"w": w}, checkpoint_id=f"{root}/x", async_checkpointer_type="fork")
    tgt = {"w": distribute_tensor(torch.zeros(4), w.device_mesh, [Shard(0)])}
    dcp.load(tgt, checkpoint_id=f"{root}/{AsyncCheckpointerType.PROCESS}")
    return tgt["w"].full_tensor().tolist()


def test_async_save_takes_torchs_checkpointer_types(tmp_path) -> None:
    """The async-checkpoint recipe imports AsyncCheckpointerType from state_dict_saver and asks
    for PROCESS; both kinds write (in a thread), anything else is refused."""
    assert run_threads(_async_kinds, 2, str(tmp_path)) == [[3.0] * 4] * 2


def test_format_utils_command_line_as_torchs(tmp_path) -> None:
    """python -m ...checkpoint.format_utils {dcp_to_torch,torch_to_dcp} SRC DST (torch's CLI) used
    to exit 0 and write nothing."""
    dcp.save({"a": torch.arange(3.0)}, checkpoint_id=tmp_path / "ck")
    cli = [sys.executable, "-m", "ringlet.distributed.checkpoint.format_utils"]
    for args in (["dcp_to_torch", "ck", "one.pt"], ["torch_to_dcp", "one.pt", "ck2"]):
        out = subprocess.run([*cli, *args], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
    assert torch.equal(torch.load(tmp_path / "one.pt", weights_only=True)["a"], torch.arange(3.0))
    back = {"a": torch.zeros(3)}
    dcp.load(back, checkpoint_id=tmp_path / "ck2")
    assert torch.equal(back["a"], torch.arange(3.0))
    bad = subprocess.run([*cli, "to_torch", "ck", "x.pt"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_overwrite_false_and_missing_checkpoint_and_file_in_the_way(tmp_path) -> None:
    dcp.save({"a": torch.ones(2)}, checkpoint_id=tmp_path / "ck")
    with pytest.raises(dcp.CheckpointException, match="overwrite=False"):
        dcp.save({"a": torch.ones(2)},
                 storage_writer=dcp.FileSystemWriter(tmp_path / "ck", overwrite=False))
    with pytest.raises(dcp.CheckpointException, match="no committed checkpoint"):
        dcp.load({"a": torch.zeros(2)}, checkpoint_id=tmp_path / "nothing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(dcp.CheckpointException, match="exists and is not a directory"):
        dcp.save({"a": torch.ones(2)}, checkpoint_id=tmp_path / "file")
    with pytest.raises(TypeError, match="custom planners are not supported"):
        dcp.save({"a": torch.ones(2)}, checkpoint_id=tmp_path / "ck", planner=object())
