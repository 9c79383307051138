"""Redistribution: a pure plan of per-axis steps, then a thin loop that runs it.

[Note: redistribution order]
Placements are applied in mesh-axis order; when several axes shard one tensor dim,
each later axis chunks what the earlier ones left (``_shard_math``).  So an axis may
only split or gather a dim while no *later* axis holds that dim split.  The plan:

1. An axis must change when its placement differs.  An axis ``j`` is *forced* through
   Replicate when an earlier axis that changes (or is forced) touches a dim that ``j``
   shards before or after: ``j`` is gathered first and split again last.
2. Backward pass, last axis to first: each changing axis leaves its source placement.
   Unforced axes take the direct collective (S->R all-gather, P->R all-reduce,
   P->S reduce-scatter, S(i)->S(j) all-to-all); forced ones are gathered or reduced to
   Replicate.  Replicate sources wait for step 3.
3. Forward pass, first axis to last: every axis still away from its target is
   Replicate now and takes its target locally (R->S: keep my chunk; R->P: partition).

Step 2 runs inner axes first, so no later axis splits a dim that an earlier axis
gathers; step 3 splits outer axes first, so nested shards nest in mesh order.

[Note: strided shards]
A ``_StridedShard`` takes its chunk after every plain shard (``_shard_math.shard_order``),
so it is the innermost split of its dim whatever its axis.  :func:`redistribute_local`
therefore gathers strided source axes first (last applied first), plans the rest between
plain placements, and takes strided target chunks last (a local chunk of what is left).
"""

from __future__ import annotations

import dataclasses

import torch

from ringlet.dtensor import _comm, _shard_math
from ringlet.dtensor._spec import Placements
from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard
from ringlet.mesh import DeviceMesh

__all__ = ["Step", "plan", "redistribute_local"]


@dataclasses.dataclass(frozen=True)
class Step:
    """One transition on one mesh axis; ``kind`` names the collective (or local op) it takes."""

    axis: int
    src: Placement
    dst: Placement

    @property
    def kind(self) -> str:
        s, d = self.src, self.dst
        if isinstance(s, Shard):
            return "all_to_all" if isinstance(d, Shard) else "all_gather"
        if isinstance(s, Partial):
            return "reduce_scatter" if isinstance(d, Shard) else "all_reduce"
        return "chunk" if isinstance(d, Shard) else "partition"

    def __repr__(self) -> str:
        return f"axis {self.axis}: {self.src}->{self.dst} ({self.kind})"   # short str tags


def _dims(p: Placement) -> set[int]:
    return {p.dim} if isinstance(p, Shard) else set()


def _forced(src: Placements, dst: Placements) -> list[bool]:
    """Axes that must pass through Replicate (see [Note: redistribution order])."""
    n = len(src)
    moving = [src[i] != dst[i] for i in range(n)]
    forced = [False] * n
    changed = True
    while changed:
        changed = False
        for j in range(n):
            touched = _dims(src[j]) | _dims(dst[j])
            if forced[j] or not touched:
                continue
            if any((moving[i] or forced[i]) and touched & (_dims(src[i]) | _dims(dst[i]))
                   for i in range(j)):
                forced[j] = changed = True
    return forced


def plan(src: Placements, dst: Placements) -> list[Step]:
    """The steps that turn placements ``src`` into ``dst`` (pure; see [Note: redistribution order]).

    >>> plan((Shard(0),), (Replicate(),))
    [axis 0: S(0)->R (all_gather)]
    """
    if len(src) != len(dst):
        raise ValueError(f"redistribute: expected placements for {len(src)} "
                         f"mesh axes, got {list(dst)}")
    forced = _forced(src, dst)
    cur = list(src)
    steps: list[Step] = []
    for i in reversed(range(len(src))):
        c, t = cur[i], dst[i]
        if c == t and not forced[i]:
            continue
        direct = not forced[i] and not isinstance(c, Replicate) and not (
            isinstance(c, Shard) and isinstance(t, Partial)) and not (
            isinstance(c, Partial) and isinstance(t, Partial))
        if direct:
            steps.append(Step(i, c, t))
            cur[i] = t
        elif not isinstance(c, Replicate):
            steps.append(Step(i, c, Replicate()))
            cur[i] = Replicate()
    for i in range(len(src)):
        if cur[i] != dst[i]:
            steps.append(Step(i, cur[i], dst[i]))
            cur[i] = dst[i]
    return steps


def redistribute_local(local: torch.Tensor, mesh: DeviceMesh, src: Placements, dst: Placements,
                       shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Run :func:`plan` on this rank's ``local`` tensor of a DTensor of global ``shape``.

    Returns a new tensor (never ``local`` itself unless nothing changes).
    """
    if tuple(src) == tuple(dst):
        return local
    coord = mesh.get_coordinate()
    if coord is None:       # an empty placeholder: nothing to move ([Note: ranks outside the mesh])
        return local
    cur = list(src)
    strided_src = [a for a in _shard_math.shard_order(cur) if _strided(cur[a])]
    for axis in reversed(strided_src):           # [Note: strided shards]
        local = _run(Step(axis, cur[axis], Replicate()), local, mesh, coord, cur, shape)
        cur[axis] = Replicate()
    plain_dst = tuple(Replicate() if _strided(p) else p for p in dst)
    for step in plan(tuple(cur), plain_dst):
        local = _run(step, local, mesh, coord, cur, shape)
        cur[step.axis] = step.dst
    for axis, p in enumerate(dst):
        if _strided(p):
            local = _run(Step(axis, Replicate(), p), local, mesh, coord, cur, shape)
            cur[axis] = p
    return local


def _strided(p: Placement) -> bool:
    return isinstance(p, Shard) and p._applied_last


def _run(step: Step, local: torch.Tensor, mesh: DeviceMesh, coord: list[int], cur: list[Placement],
         shape: tuple[int, ...] | list[int]) -> torch.Tensor:
    axis, s, d = step.axis, step.src, step.dst
    n = mesh.shape[axis]
    if isinstance(s, Replicate):
        if isinstance(d, Shard):         # copy the chunk so that the whole value can be freed
            return d.local_chunk(local, n, coord[axis]).clone(memory_format=torch.contiguous_format)
        if isinstance(d, Partial):
            return d.partition(local, coord[axis])
    elif isinstance(s, Partial):
        if isinstance(d, Shard):
            return _comm.reduce_scatter(local, mesh, axis, d.dim, s)
        if isinstance(d, Replicate):
            return _comm.all_reduce(local, mesh, axis, s)
    elif isinstance(s, Shard):
        whole = _shard_math.size_seen_by_axis(shape, mesh.shape, coord, cur, axis, s.dim)
        sizes = _shard_math.chunk_sizes(whole, n)
        if isinstance(d, Replicate):
            return _comm.all_gather(local, mesh, axis, s.dim, sizes).contiguous()
        if isinstance(d, Shard):
            return _comm.all_to_all(local, mesh, axis, s.dim, d.dim, sizes).contiguous()
    raise AssertionError(f"redistribute: no single collective for {step!r}")
