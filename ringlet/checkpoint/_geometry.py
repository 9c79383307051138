"""Boxes of a global tensor and where their elements sit in a stored chunk (pure).

A *box* is an axis-aligned block of a global tensor: per dim an offset and a size.  A
rank's shard of a DTensor is a box; so is every chunk a checkpoint stores (row-major,
contiguous, in one file).  Resharding is box intersection: a loading rank reads from
each stored chunk the part that overlaps the box it must fill.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch

__all__ = ["Box", "element_span", "find_overlap", "row_span", "tiles_exactly"]


@dataclasses.dataclass(frozen=True)
class Box:
    """``offsets[d] .. offsets[d] + sizes[d]`` along every dim ``d`` (0-d: one element)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def of(offsets: Sequence[int], sizes: Sequence[int]) -> Box:
        if len(offsets) != len(sizes):
            raise AssertionError(f"Box: {len(offsets)} offsets for {len(sizes)} sizes")
        return Box(tuple(int(o) for o in offsets), tuple(int(s) for s in sizes))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common part, or ``None`` when it holds no element."""
        offs, sizes = [], []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes, strict=True):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def relative_to(self, outer: Box) -> Box:
        """This box's offsets measured from ``outer``'s corner."""
        return Box(tuple(a - b for a, b in zip(self.offsets, outer.offsets, strict=True)),
                   self.sizes)

    def overlaps(self, other: Box) -> bool:
        return self.intersect(other) is not None

    def __str__(self) -> str:
        return "[" + ", ".join(f"{o}:{o + s}"
                               for o, s in zip(self.offsets, self.sizes, strict=True)) + "]"


def _strides(sizes: Sequence[int]) -> list[int]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides


def element_span(chunk_sizes: Sequence[int], inner: Box) -> tuple[int, int]:
    """First and one-past-last flat index, in a row-major chunk, of the box ``inner``
    (given relative to the chunk).  The box is contiguous there iff the span equals its numel."""
    st = _strides(chunk_sizes)
    first = sum(o * s for o, s in zip(inner.offsets, st, strict=True))
    last = sum((o + n - 1) * s for o, n, s in zip(inner.offsets, inner.sizes, st, strict=True))
    return first, last + 1


def row_span(chunk_sizes: Sequence[int], inner: Box) -> tuple[int, int]:
    """Flat index range of the whole dim-0 rows of a row-major chunk that hold ``inner``
    (what a reader fetches to cut a non-contiguous box out of a chunk)."""
    if not chunk_sizes:
        return 0, 1
    row = math.prod(chunk_sizes[1:])
    return inner.offsets[0] * row, (inner.offsets[0] + inner.sizes[0]) * row


def _cut_dims(shape: Sequence[int], boxes: Sequence[Box]) -> list[int]:
    """The dims along which some box does not span the whole shape."""
    return [d for d, n in enumerate(shape)
            if any(b.offsets[d] != 0 or b.sizes[d] != n for b in boxes)]


def tiles_exactly(shape: Sequence[int], boxes: Sequence[Box],
                  budget: int = 1 << 24) -> bool | None:
    """Whether ``boxes`` (each inside ``shape``) cover every element of ``shape`` exactly once;
    ``None`` when the check would hold more than ``budget`` numbers.

    A box's indicator is a product over dims of ``step(x - lo) - step(x - hi)``; expanded, it is a
    signed sum over the box's corners of "everything above and right of this corner", and those
    functions are independent for distinct corners.  So the boxes add up to the shape's box -- each
    element covered once -- iff every corner point has the same signed count on both sides: the
    corners (``2 ** k`` per box, ``k`` the dims that are cut) are sorted and summed once, with no
    pairwise test.
    """
    boxes = [b for b in boxes if b.numel > 0]      # an empty box covers nothing
    if math.prod(shape) == 0:
        return not boxes
    dims = _cut_dims(shape, boxes)
    if len(dims) <= 1:      # uncut (one box must hold it all), or intervals along one dim
        d = dims[0] if dims else 0
        spans = sorted((b.offsets[d], b.offsets[d] + b.sizes[d]) for b in boxes) if dims else []
        ends = [lo for lo, _ in spans[1:]] == [hi for _, hi in spans[:-1]]
        return len(boxes) == 1 if not dims else (ends and spans[0][0] == 0
                                                 and spans[-1][1] == shape[d])
    if ((len(boxes) + 1) << len(dims)) * len(dims) > budget:
        return None
    lo = torch.tensor([[b.offsets[d] for d in dims] for b in boxes] + [[0] * len(dims)],
                      dtype=torch.int64)
    hi = lo + torch.tensor([[b.sizes[d] for d in dims] for b in boxes] + [[shape[d] for d in dims]],
                           dtype=torch.int64)
    weight = torch.ones(len(boxes) + 1, dtype=torch.int64)
    weight[-1] = -1                                # the shape's own box, subtracted
    points, signs = [], []
    for upper in itertools.product((False, True), repeat=len(dims)):
        points.append(torch.where(torch.tensor(upper), hi, lo))
        signs.append(weight * (-1) ** sum(upper))
    every = torch.cat(points)
    where = torch.zeros(len(every), dtype=torch.int64)    # each point's rank among the points
    for d in range(len(dims)):        # one dim at a time: ranks stay below the number of points
        _, along = torch.unique(every[:, d], return_inverse=True)
        _, where = torch.unique(where * (int(along.max()) + 1) + along, return_inverse=True)
    counts = torch.zeros(int(where.max()) + 1, dtype=torch.int64)
    counts.index_add_(0, where, torch.cat(signs))
    return not bool(counts.any())


def find_overlap(boxes: Sequence[Box], budget: int = 1 << 20) -> tuple[int, int] | None:
    """Indices ``(i, j)`` of two boxes sharing an element, found by a sweep along dim 0, or
    ``None`` (none found within ``budget`` box comparisons)."""
    live = [i for i, b in enumerate(boxes) if b.numel > 0]
    if live and not boxes[live[0]].sizes:               # 0-d: every box is the one element
        return (live[0], live[1]) if len(live) > 1 else None
    live.sort(key=lambda i: boxes[i].offsets[0])
    active: list[int] = []
    for i in live:
        start = boxes[i].offsets[0]
        active = [j for j in active if boxes[j].offsets[0] + boxes[j].sizes[0] > start]
        budget -= len(active) + 1
        if budget < 0:
            return None
        for j in active:
            if boxes[i].overlaps(boxes[j]):
                return (j, i)
        active.append(i)
    return None
