"""Construction-time agreement between ranks: same model everywhere, then rank 0's values.

- :func:`verify_same_model` all-gathers every rank's parameter and buffer descriptions (name,
  shape, dtype, in registration order) and raises on *every* rank, naming the first differing
  entry and both ranks' versions (docs/reliability.md, row D1), before any tensor is broadcast -- a
  broadcast between different shapes would fail obscurely or, worse, succeed on the bytes.
- :func:`broadcast_coalesced` copies rank ``src``'s tensors to every rank, packed into one flat
  buffer per dtype (and per ``cap_bytes``) so that a model with hundreds of small tensors costs
  a few collectives, not hundreds.
- :func:`live_buffers` and :func:`swap_buffers`: the module's buffers as they are now, and
  putting broadcast replacements in their place (DDP's buffer syncs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import all_gather_object, broadcast

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["broadcast_coalesced", "describe", "first_difference", "live_buffers", "swap_buffers",
           "verify_same_model"]

Entry = tuple[str, str, tuple[int, ...], str]    # (kind, name, shape, dtype)

# Packs of at most 250 MiB keep the staging buffer bounded for very large models (torch's DDP
# syncs module states in 250 MiB buckets too).
BROADCAST_CAP_BYTES = 250 << 20


def describe(params: Sequence[tuple[str, torch.Tensor]], buffers: Sequence[tuple[str, torch.Tensor]]
             ) -> list[Entry]:
    """What must match across ranks: each parameter's and buffer's name,
    shape and dtype, in order."""
    out: list[Entry] = []
    for kind, named in (("parameter", params), ("buffer", buffers)):
        for name, t in named:
            out.append((kind, name, tuple(t.shape), str(t.dtype).removeprefix("torch.")))
    return out


def _fmt(e: Entry | None) -> str:
    if e is None:
        return "nothing"
    kind, name, shape, dtype = e
    return f"{kind} '{name}' {list(shape)} {dtype}"


def first_difference(mine: list[Entry], ref: list[Entry]) -> str | None:
    """Describe how ``mine`` differs from ``ref`` (None if identical)."""
    if mine == ref:
        return None
    counts = []
    for kind in ("parameter", "buffer"):
        a = sum(1 for e in mine if e[0] == kind)
        b = sum(1 for e in ref if e[0] == kind)
        if a != b:
            counts.append(f"{a} {kind}s vs {b}")
    for k in range(max(len(mine), len(ref))):
        x = mine[k] if k < len(mine) else None
        y = ref[k] if k < len(ref) else None
        if x != y:
            where = f"at entry {k}: {_fmt(x)}, rank 0 has {_fmt(y)}"
            return (f"{'; '.join(counts)}; first difference "
                    if counts else "first difference ") + where
    raise AssertionError("entries differ but no differing position was found")


def verify_same_model(entries: list[Entry], pg: ProcessGroup) -> None:
    """Raise ``RuntimeError`` on every rank if any rank's ``entries`` differ from rank 0's."""
    gathered: list[Any] = [None] * pg.size()
    all_gather_object(gathered, entries, group=pg)
    problems = []
    for r in range(1, pg.size()):
        diff = first_difference(gathered[r], gathered[0])
        if diff is not None:
            problems.append(f"rank {r}: {diff}")
    if problems:
        raise RuntimeError(
            f"DistributedDataParallel (rank {pg.rank()}): expected the same parameters "
            "and buffers (names, shapes, dtypes, order) on every rank as on rank 0, "
            f"got: {' | '.join(problems)}")


def broadcast_coalesced(tensors: Sequence[torch.Tensor], pg: ProcessGroup, src: int,
                        cap_bytes: int = BROADCAST_CAP_BYTES,
                        replace: bool = False) -> list[torch.Tensor]:
    """Give every rank group rank ``src``'s values of ``tensors`` (few collectives).

    Overwrites the tensors in place, or with ``replace=True`` leaves them alone on receiving
    ranks and returns new tensors holding the values (for tensors that an autograd graph may
    have saved: overwriting them would fail that graph's backward).  Returns the tensors that
    hold the result, in order.
    """
    result = list(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for k, t in enumerate(tensors):
        if t.numel():
            by_dtype.setdefault(t.dtype, []).append(k)
    receiving = pg.rank() != src
    with torch.no_grad():
        for group in by_dtype.values():
            for pack in _packs([tensors[k] for k in group], group, cap_bytes):
                if len(pack) == 1:       # one tensor: broadcast it (or its replacement) directly
                    k = pack[0]
                    target = tensors[k].clone() if replace and receiving else tensors[k]
                    broadcast(target, group=pg, group_src=src)
                    result[k] = target
                    continue
                flat = torch.cat([tensors[k].reshape(-1) for k in pack])
                broadcast(flat, group=pg, group_src=src)
                if receiving:
                    _unpack(flat, pack, tensors, result, replace)
    return result


def _unpack(flat: torch.Tensor, pack: list[int], tensors: Sequence[torch.Tensor],
            result: list[torch.Tensor], replace: bool) -> None:
    off = 0
    for k in pack:
        t = tensors[k]
        piece = flat[off:off + t.numel()].view(t.shape)
        off += t.numel()
        if replace:
            result[k] = piece.clone()
        else:
            t.copy_(piece)


def _packs(ts: list[torch.Tensor], keys: list[int], cap_bytes: int) -> list[list[int]]:
    packs: list[list[int]] = [[]]
    size = 0
    for t, k in zip(ts, keys):
        nbytes = t.numel() * t.element_size()
        if packs[-1] and size + nbytes > cap_bytes:
            packs.append([])
            size = 0
        packs[-1].append(k)
        size += nbytes
    return packs


def live_buffers(slots: Sequence[tuple[str, torch.nn.Module, str]]
                 ) -> list[tuple[str, torch.Tensor]]:
    """The buffers now held at ``slots`` (fully-qualified name, module, attribute), each tensor
    once, as ``named_buffers`` lists them (``module.to()`` may have replaced the tensors)."""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for fqn, mod, name in slots:
        b = mod._buffers.get(name)
        if b is not None and id(b) not in seen:
            seen.add(id(b))
            out.append((fqn, b))
    return out


def swap_buffers(module: torch.nn.Module, old: Sequence[torch.Tensor],
                 new: Sequence[torch.Tensor]) -> None:
    """Register ``new[k]`` wherever ``module`` holds ``old[k]`` as a buffer (where they differ:
    ``broadcast_coalesced(..., replace=True)`` returned a new tensor)."""
    swaps = {id(o): t for o, t in zip(old, new) if t is not o}
    if not swaps:
        return
    for mod in module.modules():
        for name, b in mod._buffers.items():
            if b is not None and id(b) in swaps:
                mod._buffers[name] = swaps[id(b)]
