"""Save and load plans (pure: no process group, no file).

Saving: every rank describes what it holds (per tensor: dtype, global shape and the box
of its local piece; plain values).  After one all-gather every rank runs
:func:`plan_save` on the same list and gets the same answer: the global table of tensors
and, for each box held by several ranks (replicated tensors, DDP parameters, replicated
mesh axes), exactly one *owner* that writes it -- chosen deterministically, largest
boxes first, to the holder that has been given the fewest bytes so far (ties: the
lowest rank), so replicated state is written once and the writing is spread out.

Loading: :func:`plan_reads` intersects the box a rank must fill with the stored chunks
and says, per overlap, which byte range of which file to read and which checksum blocks
cover it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ringlet.checkpoint._flatten import Path
from ringlet.checkpoint._geometry import Box, element_span, find_overlap, row_span, tiles_exactly
from ringlet.checkpoint._metadata import BLOCK_BYTES, DTYPES, ChunkMeta, TensorMeta

__all__ = ["ReadOp", "SavePlan", "TensorInfo", "plan_reads", "plan_save"]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    path: Path
    dtype: str
    shape: tuple[int, ...]

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][0].itemsize


@dataclasses.dataclass
class SavePlan:
    """The same on every rank: what exists, and who writes which box."""

    tensors: dict[str, TensorInfo]
    values: dict[str, tuple[Path, Any]]
    writes: dict[int, list[tuple[str, Box]]]     # rank -> (key, box) it writes, in file order


def plan_save(payloads: list[dict[str, Any]]) -> SavePlan:
    """Merge every rank's description (``payloads[r]`` from rank ``r``) into one plan.

    Raises:
        ValueError: ranks disagree on a tensor's dtype or shape, or their boxes do not
            tile a tensor (overlapping pieces, or pieces missing).
    """
    tensors: dict[str, TensorInfo] = {}
    first_rank: dict[str, int] = {}
    holders: dict[tuple[str, Box], list[int]] = {}
    values: dict[str, tuple[Path, Any]] = {}
    for rank, p in enumerate(payloads):
        for key, path, dtype, shape, offsets, sizes in p["tensors"]:
            info = TensorInfo(tuple(path), dtype, tuple(shape))
            if key in tensors and tensors[key] != info:
                raise ValueError(f"state_dict[{key!r}]: rank {first_rank[key]} has "
                                 f"{_desc(tensors[key])}, rank {rank} has {_desc(info)}")
            tensors.setdefault(key, info)
            first_rank.setdefault(key, rank)
            box = Box.of(offsets, sizes)
            if box.numel:
                holders.setdefault((key, box), []).append(rank)
        for key, path, value in p["values"]:
            values.setdefault(key, (tuple(path), value))   # the lowest rank's value is kept
    clash = set(tensors) & set(values)
    if clash:
        raise ValueError(f"state_dict keys {sorted(clash)[:5]} are tensors on some "
                         "ranks and values on others")
    _check_tiling(tensors, holders)
    return SavePlan(tensors, values, _assign_owners(tensors, holders, len(payloads)))


def _desc(info: TensorInfo) -> str:
    return f"{info.dtype}{list(info.shape)}"


def _check_tiling(tensors: dict[str, TensorInfo],
                  holders: dict[tuple[str, Box], list[int]]) -> None:
    boxes: dict[str, list[Box]] = {}
    for key, box in holders:
        boxes.setdefault(key, []).append(box)
    for key, info in tensors.items():
        mine = boxes.get(key, [])
        exact = tiles_exactly(info.shape, mine)   # one pass, not every pair (thousands of ranks)
        if exact:
            continue
        pair = find_overlap(mine)
        if pair is not None:
            a, b = (mine[i] for i in pair)
            raise ValueError(f"state_dict[{key!r}]: ranks hold overlapping "
                             f"pieces {a} and {b} that are not the same piece (a "
                             "DTensor on two different meshes?)")
        total = sum(b.numel for b in mine)
        want = math.prod(info.shape)
        if total != want:
            raise ValueError(f"state_dict[{key!r}]: the ranks' pieces hold "
                             f"{total} of its {want} elements")
        if exact is False:
            raise ValueError(f"state_dict[{key!r}]: ranks hold overlapping pieces that are not "
                             "the same piece (a DTensor on two different meshes?)")


def _assign_owners(tensors: dict[str, TensorInfo], holders: dict[tuple[str, Box], list[int]],
                   world: int) -> dict[int, list[tuple[str, Box]]]:
    order = {k: i for i, k in enumerate(tensors)}
    load = [0] * world
    owner: dict[tuple[str, Box], int] = {}
    by_size = sorted(holders, key=lambda kb: (-kb[1].numel * tensors[kb[0]].itemsize, order[kb[0]],
                                              kb[1].offsets))
    for kb in by_size:
        r = min(holders[kb], key=lambda h: (load[h], h))
        owner[kb] = r
        load[r] += kb[1].numel * tensors[kb[0]].itemsize
    writes: dict[int, list[tuple[str, Box]]] = {r: [] for r in range(world)}
    for kb in sorted(owner, key=lambda kb: (order[kb[0]], kb[1].offsets)):
        writes[owner[kb]].append(kb)
    return writes


@dataclasses.dataclass(frozen=True)
class ReadOp:
    """Read ``inter`` (global coordinates) of one stored chunk.

    ``lo``..``hi`` is the byte range of the file to fetch: exactly the box when it is
    contiguous in the chunk (``direct``), else the whole dim-0 rows that hold it
    (``first_row`` is the first of them).  ``blocks`` are the checksum blocks covering it.
    """

    chunk: ChunkMeta
    inter: Box
    lo: int
    hi: int
    direct: bool
    first_row: int
    blocks: range


def plan_reads(meta: TensorMeta, target: Box) -> list[ReadOp]:
    """The reads that fill ``target`` from ``meta``'s chunks (in chunk order)."""
    item = DTYPES[meta.dtype][0].itemsize
    ops = []
    for chunk in meta.chunks:
        inter = chunk.box.intersect(target)
        if inter is None:
            continue
        rel = inter.relative_to(chunk.box)
        first, stop = element_span(chunk.box.sizes, rel)
        direct = stop - first == inter.numel
        if not direct:
            first, stop = row_span(chunk.box.sizes, rel)
        lo, hi = chunk.begin + first * item, chunk.begin + stop * item
        blocks = range((lo - chunk.begin) // BLOCK_BYTES, (hi - 1 - chunk.begin) // BLOCK_BYTES + 1)
        ops.append(ReadOp(chunk, inter, lo, hi, direct, rel.offsets[0] if rel.offsets else 0,
                          blocks))
    covered = sum(op.inter.numel for op in ops)
    if covered != target.numel:
        raise ValueError(f"{meta.key!r}: the stored chunks hold {covered} of the "
                         f"{target.numel} elements of {target}")
    return ops
