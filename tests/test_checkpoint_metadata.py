"""Checkpoint metadata that is large or hostile: the tiling check is linear in the chunks, no two
chunks share bytes of a file, and entries whose paths run into each other or nest too deep are
clear errors naming the file and the field (docs/checkpoint.md, "What a load checks")."""

from __future__ import annotations

import itertools
import json
import math
import random
import re
from pathlib import Path

import pytest
import torch

from ringlet.checkpoint import cli
from ringlet.checkpoint._flatten import MAX_DEPTH, flatten
from ringlet.checkpoint._geometry import Box, find_overlap, tiles_exactly
from ringlet.checkpoint._metadata import Metadata
from ringlet.checkpoint._planner import plan_save
from ringlet.checkpoint.format_utils import _save_local

pytestmark = pytest.mark.timeout(60)


def _doc(tensors: dict, files: dict | None = None) -> dict:
    return {"format": "ringlet-checkpoint", "version": 1, "save_id": "ab", "world_size": 1,
            "checksum": {"algorithm": "crc32", "block_bytes": 1 << 20},
            "files": files or {"shard-a": {"bytes": 1 << 30}}, "tensors": tensors, "values": {}}


def _chunks(boxes: list[tuple[list[int], list[int]]], begin: int = 0, file: str = "shard-a",
            itemsize: int = 4) -> list[dict]:
    out = []
    for offsets, sizes in boxes:
        n = itemsize * math.prod(sizes)
        out.append({"offsets": offsets, "sizes": sizes, "file": file, "begin": begin,
                    "end": begin + n, "crc32": [0] * max(1, -(-n // (1 << 20))) if n else []})
        begin += n
    return out


def _tensor(key: str, shape: list[int], chunks: list[dict]) -> dict:
    return {key: {"path": [key], "dtype": "float32", "shape": shape, "chunks": chunks}}


def _parse(doc: dict) -> Metadata:
    return Metadata.from_json_bytes(json.dumps(doc).encode(), "ck/metadata.json")


# -- the tiling check -----------------------------------------------------------------------------
def test_100k_chunks_are_checked_in_one_pass() -> None:
    """A tensor sharded over 100 000 ranks (the pairwise check took 22 s for 4000 chunks and never
    finished at 20 000); then one chunk moved onto its neighbour."""
    n = 100_000
    boxes = [([i], [1]) for i in range(n)]
    random.Random(0).shuffle(boxes)
    assert _parse(_doc(_tensor("w", [n], _chunks(boxes)))).tensors["w"].chunks[0].box.numel == 1
    grid = [([i, j], [1, 1]) for i in range(250) for j in range(400)]
    assert len(_parse(_doc(_tensor("g", [250, 400], _chunks(grid)))).tensors["g"].chunks) == n
    moved = [*boxes[:-1], ([boxes[-2][0][0]], [1])]
    with pytest.raises(ValueError, match=rf"ck/metadata.json: .*tensors\['w'\]: chunks\[{n - 2}\] "
                                         rf"\[\d+:\d+\] and chunks\[{n - 1}\] \[\d+:\d+\] overlap"):
        _parse(_doc(_tensor("w", [n], _chunks(moved))))


def _brute_tiles(shape: tuple[int, ...], boxes: list[Box]) -> bool:
    if any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2)):
        return False
    return sum(b.numel for b in boxes) == math.prod(shape)


def test_corner_count_agrees_with_the_pairwise_check() -> None:
    """Random boxes (tilings, overlaps, gaps, empty boxes, up to 3 cut dims): the one-pass check
    says what comparing every pair says."""
    rng = random.Random(1)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        shape = tuple(rng.randint(0, 4) for _ in range(rng.randint(0, 3)))
        boxes = []
        for _ in range(rng.randint(0, 6)):
            lo = [rng.randint(0, n) for n in shape]
            boxes.append(Box(tuple(lo), tuple(rng.randint(0, n - a) for a, n in zip(lo, shape))))
        if rng.random() < 0.5 and all(shape):      # a real tiling: cut each dim somewhere
            cuts = [sorted({0, n, rng.randint(0, n)}) for n in shape]
            boxes = [Box(tuple(c[0] for c in cell), tuple(c[1] - c[0] for c in cell))
                     for cell in itertools.product(*[list(itertools.pairwise(c)) for c in cuts])]
        want = _brute_tiles(shape, boxes)
        assert tiles_exactly(shape, boxes) is want, (shape, boxes)
        seen[want] += 1
        if not want and sum(b.numel for b in boxes) > math.prod(shape):
            assert find_overlap(boxes) is not None, (shape, boxes)
    assert min(seen.values()) > 300
    assert tiles_exactly((4,) * 30, [Box((0,) * 30, (4,) * 30)]) is True
    assert tiles_exactly((2,) * 30, [Box((a,) * 30, (1,) * 30) for a in (0, 1)]) is None
    corners = [([int(d == i) for d in range(20)], [1] * 20) for i in range(21)]
    with pytest.raises(ValueError, match=r"tensors\['w'\]: 21 chunks cut too many dims to check"):
        _parse(_doc(_tensor("w", [2] * 20, _chunks(corners))))


# -- bytes shared between chunks -------------------------------------------------------------------
def test_chunks_sharing_bytes_of_a_file_are_refused() -> None:
    """200 tensors over one 1 MiB range would load as 200 MiB: refused, naming the file and two of
    the tensors; ranges that only touch are fine."""
    one = _chunks([([0], [1 << 18])])          # 1 MiB of float32
    tensors = {}
    for i in range(200):
        tensors.update(_tensor(f"t{i}", [1 << 18], one))
    with pytest.raises(ValueError, match=r"ck/metadata.json: .*files\['shard-a'\]: bytes "
                                         r"\[0, 1048576\) are claimed by both "
                                         r"tensors\['t0'\].chunks\[0\] and "
                                         r"tensors\['t1'\].chunks\[0\]"):
        _parse(_doc(tensors))
    same = _chunks([([0], [2]), ([2], [2])])
    same[1].update(begin=4, end=12)            # chunk 1 starts inside chunk 0
    with pytest.raises(ValueError, match=r"bytes \[4, 8\) are claimed by both "
                                         r"tensors\['w'\].chunks\[0\] and "
                                         r"tensors\['w'\].chunks\[1\]"):
        _parse(_doc(_tensor("w", [4], same)))
    ok = {**_tensor("a", [4], _chunks([([0], [4])])),
          **_tensor("b", [4], _chunks([([0], [4])], begin=16)),
          **_tensor("e", [0], _chunks([([0], [0])], begin=8))}   # empty: holds no bytes
    assert set(_parse(_doc(ok)).tensors) == {"a", "b", "e"}


# -- paths ----------------------------------------------------------------------------------------
def _saved(tmp_path: Path) -> tuple[Path, dict]:
    ck = tmp_path / "ck"
    _save_local({"a": torch.ones(2), "x": {"y": 1}}, str(ck))
    return ck, json.loads((ck / "metadata.json").read_text())


@pytest.mark.parametrize("case", ["value below a tensor", "value above a tensor", "too deep"])
def test_paths_that_run_into_each_other_or_nest_too_deep_are_named(
        tmp_path: Path, case: str, capsys: pytest.CaptureFixture[str]) -> None:
    ck, doc = _saved(tmp_path)
    if case == "value below a tensor":          # "a" is a tensor; "a.b" a value under it
        doc["values"]["a.b"] = {"path": ["a", "b"], "value": 1}
        want = (r"values\['a.b'\].path: \['a', 'b'\] runs through tensors\['a'\], "
                "which is itself an entry")
    elif case == "value above a tensor":        # the tensor "x.y" sits below the value "x"
        doc["tensors"]["x.y"] = doc["tensors"].pop("a") | {"path": ["x", "y"]}
        doc["values"] = {"x": {"path": ["x"], "value": 1}}
        want = (r"values\['x'\].path: \['x'\] is an entry and also the start of "
                r"tensors\['x.y'\]")
    else:
        path = ["d", *([0] * 100_000)]
        doc["values"][".".join(map(str, path))] = {"path": path, "value": 1}
        want = rf"path: expected at most {MAX_DEPTH} parts, got 100001"
    (ck / "metadata.json").write_text(json.dumps(doc))
    assert cli.main(["to-torch", str(ck), str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert f"to-torch: ValueError: {ck / 'metadata.json'}: not a valid ringlet checkpoint" in err
    assert re.search(want, err), err
    assert not (tmp_path / "out.pt").exists()


def test_state_dicts_nested_deeper_than_a_checkpoint_holds_are_refused_on_save() -> None:
    deep: dict = {"leaf": 1}
    for _ in range(MAX_DEPTH):
        deep = {"n": deep}
    with pytest.raises(ValueError, match=rf"state_dict: 'n.n.n.n.n.n.n.n'...: nested more than "
                                         rf"{MAX_DEPTH} levels deep"):
        flatten(deep)
    assert len(next(iter(flatten(deep["n"]).values())).path) == MAX_DEPTH


def test_save_plan_of_a_tensor_over_20k_ranks_is_checked_in_one_pass() -> None:
    """The save side's tiling check (every rank's piece) is the same one pass."""
    n = 20_000
    rows = [{"tensors": [["w", ["w"], "float32", [n, 2], [i, 0], [1, 2]]], "values": []}
            for i in range(n)]
    assert sum(len(w) for w in plan_save(rows).writes.values()) == n
    rows[-1]["tensors"][0][4:] = [[n - 2, 0], [2, 2]]   # the last piece starts a row early
    with pytest.raises(ValueError, match=r"state_dict\['w'\]: ranks hold overlapping pieces "
                                         rf"\[{n - 2}:{n - 1}, 0:2\] and \[{n - 2}:{n}, 0:2\]"):
        plan_save(rows)
