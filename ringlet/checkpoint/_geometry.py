"""Boxes of a global tensor and where their elements sit in a stored chunk (pure).

A *box* is an axis-aligned block of a global tensor: per dim an offset and a size.  A
rank's shard of a DTensor is a box; so is every chunk a checkpoint stores (row-major,
contiguous, in one file).  Resharding is box intersection: a loading rank reads from
each stored chunk the part that overlaps the box it must fill.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["Box", "element_span", "row_span"]


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
