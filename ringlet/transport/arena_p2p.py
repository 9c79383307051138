"""Point-to-point messages over an arena's pair mailboxes (``shm``, ``inproc``).

See [Note: arena protocol] in ``arena.py``: each ordered pair of ranks has a mailbox of two
buffers and two counters, ``sent`` (written by the sender) and ``acked`` (by the receiver).
A message travels in chunks of ``p2p_bytes``; chunk ``m`` goes into buffer ``m % 2`` once the
receiver has acknowledged chunk ``m - 2``, with a header (tag, size, chunk index, dtype code)
that the receiver checks before it reads the payload.
"""

from __future__ import annotations

import torch

from ringlet.errors import CollectiveMismatchError
from ringlet.transport.arena import Arena
from ringlet.transport.base import OpContext, chunks, message_code, message_mismatch

__all__ = ["Mailboxes"]


class Mailboxes:
    """This rank's side of every pair mailbox of ``arena``."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.rank = arena.rank
        self.sent = [0] * arena.world_size     # chunks this rank posted to each peer
        self.recvd = [0] * arena.world_size    # chunks this rank consumed from each peer

    def _pair_i(self, src: int, dst: int) -> tuple[int, int]:
        off = self.arena.layout.pair_off(src, dst) // 8
        return off, off + 8   # (sent counter written by src, acked counter written by dst)

    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        a, q = self.arena, self.arena.q
        data = buf.reshape(-1).view(torch.uint8)
        nbytes = data.numel()
        code = message_code(ctx)
        sent_i, acked_i = self._pair_i(self.rank, dst)
        for k, (off, c) in enumerate(chunks(nbytes, a.layout.p2p_bytes)):
            m = self.sent[dst] + 1
            b = m & 1
            a.wait_ge([acked_i], [dst], m - 2, ctx)
            a.mailbox(self.rank, dst, b)[:c].copy_(data[off:off + c])
            h = a.layout.mailbox_hdr_off(self.rank, dst, b) // 8
            q[h + 1], q[h + 2], q[h + 3], q[h + 4], q[h + 5] = tag, nbytes, k, c, code
            q[h] = m
            q[sent_i] = m
            a.notify()
            self.sent[dst] = m

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        a, q = self.arena, self.arena.q
        if src is None:
            src = self._wait_any_source(ctx)
        data = buf.reshape(-1).view(torch.uint8)
        nbytes = data.numel()
        code = message_code(ctx)
        sent_i, acked_i = self._pair_i(src, self.rank)
        for k, (off, c) in enumerate(chunks(nbytes, a.layout.p2p_bytes)):
            m = self.recvd[src] + 1
            b = m & 1
            a.wait_ge([sent_i], [src], m, ctx)
            h = a.layout.mailbox_hdr_off(src, self.rank, b) // 8
            got = (q[h + 1], q[h + 2], q[h + 3], q[h + 4], q[h + 5])
            if got != (tag, nbytes, k, c, code):
                raise ctx.error(CollectiveMismatchError, message_mismatch(
                    src, (int(got[0]), int(got[1]), int(got[4])), ctx, (tag, nbytes)), peer=src)
            data[off:off + c].copy_(a.mailbox(src, self.rank, b)[:c])
            q[acked_i] = m
            a.notify()
            self.recvd[src] = m
        return src

    def pending_source(self) -> int | None:
        """The lowest rank with a message chunk this rank has not consumed yet (no waiting)."""
        q = self.arena.q
        for r in self.arena.peers:
            if q[self._pair_i(r, self.rank)[0]] > self.recvd[r]:
                return r
        return None

    def _wait_any_source(self, ctx: OpContext) -> int:
        peers = self.arena.peers
        idx = [self._pair_i(r, self.rank)[0] for r in peers]
        k = self.arena.wait_any_gt(idx, peers, [self.recvd[r] for r in peers], ctx)
        return peers[k]
