"""The checkpoint schema has one writer and one reader (ringlet/checkpoint/_metadata.py):
``Metadata.to_json_bytes`` writes every field that ``Metadata.from_json_bytes`` reads, ``save``
writes metadata.json through it, the parser is chosen by the document's format version, and a
metadata.json written before the writer moved there reads back and rewrites byte for byte."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ringlet.checkpoint import _metadata
from ringlet.checkpoint._geometry import Box
from ringlet.checkpoint._metadata import ChunkMeta, Metadata, TensorMeta
from ringlet.checkpoint.format_utils import _save_local

pytestmark = pytest.mark.timeout(60)

# metadata.json of a one-rank save written by ringlet at e73e656 (before the schema moved into
# one writer): nested values of every JSON kind, a 0-d, an empty and a two-block tensor.
GOLDEN = (
    b'{"format":"ringlet-checkpoint","version":1,"save_id":"0123456789abcdef","world_size":1,"'
    b'checksum":{"algorithm":"crc32","block_bytes":1048576},"files":{"shard-0123456789abcdef-0'
    b'0000.safetensors":{"bytes":1200422}},"tensors":{"model.w":{"path":["model","w"],"dtype":'
    b'"float32","shape":[2,3],"chunks":[{"offsets":[0,0],"sizes":[2,3],"file":"shard-012345678'
    b'9abcdef-00000.safetensors","begin":384,"end":408,"crc32":[2447872023]}]},"model.b":{"pat'
    b'h":["model","b"],"dtype":"bfloat16","shape":[3],"chunks":[{"offsets":[0],"sizes":[3],"fi'
    b'le":"shard-0123456789abcdef-00000.safetensors","begin":408,"end":414,"crc32":[2982322595'
    b']}]},"model.big":{"path":["model","big"],"dtype":"float32","shape":[300000],"chunks":[{"'
    b'offsets":[0],"sizes":[300000],"file":"shard-0123456789abcdef-00000.safetensors","begin":'
    b'414,"end":1200414,"crc32":[731586381,311436332]}]},"scalar":{"path":["scalar"],"dtype":"'
    b'float64","shape":[],"chunks":[{"offsets":[],"sizes":[],"file":"shard-0123456789abcdef-00'
    b'000.safetensors","begin":1200414,"end":1200422,"crc32":[2006080509]}]},"empty":{"path":['
    b'"empty"],"dtype":"int64","shape":[0,4],"chunks":[]}},"values":{"step":{"path":["step"],"'
    b'value":7},"opt.lr":{"path":["opt","lr"],"value":0.125},"opt.betas.0":{"path":["opt","bet'
    b'as",0],"value":0.9},"opt.betas.1":{"path":["opt","betas",1],"value":0.999},"opt.name":{"'
    b'path":["opt","name"],"value":"adam"},"opt.flags.0":{"path":["opt","flags",0],"value":tru'
    b'e},"opt.flags.1":{"path":["opt","flags",1],"value":null}}}'
)


def _every_field() -> Metadata:
    """Two ranks' files, a tensor in two chunks (one of two crc blocks), paths with int parts."""
    f0, f1 = "shard-ab-00000.safetensors", "shard-ab-00001.safetensors"
    w = TensorMeta("layer.0.w", ("layer", 0, "w"), "bfloat16", (4, 3),
                   (ChunkMeta(Box((0, 0), (2, 3)), f0, 8, 20, (11,)),
                    ChunkMeta(Box((2, 0), (2, 3)), f1, 0, 12, (4294967295,))))
    big = TensorMeta("big", ("big",), "float64", (131073,),
                     (ChunkMeta(Box((0,), (131073,)), f0, 20, 20 + 131073 * 8, (1, 2)),))
    empty = TensorMeta("empty", ("empty",), "int8", (0, 5), ())
    files = {f0: 20 + 131073 * 8, f1: 12}
    values = {"step": (("step",), 3), "opt.lr": (("opt", "lr"), 0.5),
              "opt.betas.1": (("opt", "betas", 1), None), "name": (("name",), "x"),
              "flag": (("flag",), True)}
    return Metadata("0a1b", 2, files, {t.key: t for t in (w, big, empty)}, values)


def test_every_field_is_written_and_read_back_by_the_one_pair() -> None:
    meta = _every_field()
    raw = meta.to_json_bytes()
    back = Metadata.from_json_bytes(raw)
    assert back == meta
    assert back.to_json_bytes() == raw
    doc = json.loads(raw)
    assert (doc["format"], doc["version"], doc["world_size"]) == ("ringlet-checkpoint", 1, 2)
    assert list(doc["tensors"]["layer.0.w"]["chunks"][1]) == [
        "offsets", "sizes", "file", "begin", "end", "crc32"]


def test_metadata_written_before_reads_back_and_rewrites_byte_for_byte() -> None:
    meta = Metadata.from_json_bytes(GOLDEN)
    assert meta.tensors["model.big"].chunks[0].crc32 == (731586381, 311436332)
    assert meta.value("opt.flags.0") is True and meta.value("step") == 7
    assert meta.to_json_bytes() == GOLDEN


def test_save_writes_metadata_through_to_json_bytes(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = Metadata.to_json_bytes

    def spied(self: Metadata) -> bytes:
        calls.append(self.save_id)
        return real(self)
    monkeypatch.setattr(Metadata, "to_json_bytes", spied)
    _save_local({"w": torch.arange(6.0).view(2, 3), "n": {"k": 1}}, str(tmp_path))
    raw = (tmp_path / "metadata.json").read_bytes()
    assert len(calls) == 1
    assert real(Metadata.from_json_bytes(raw)) == raw


def test_the_parser_is_chosen_by_the_format_version(monkeypatch: pytest.MonkeyPatch) -> None:
    doc = json.loads(_every_field().to_json_bytes())
    seen = []
    monkeypatch.setitem(_metadata._PARSERS, 2, lambda d: seen.append(d["version"]) or "v2")
    assert Metadata.from_json_bytes(json.dumps({**doc, "version": 2}).encode()) == "v2"
    assert seen == [2]
    assert Metadata.from_json_bytes(json.dumps(doc).encode()) == _every_field()
    for bad in (3, True, "1", None):
        with pytest.raises(ValueError, match=r"version: expected 1 or 2, got"):
            Metadata.from_json_bytes(json.dumps({**doc, "version": bad}).encode())
