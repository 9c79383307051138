"""Why an operation of the ``tcp`` transport cannot go on: the errors every part raises alike.

A collective (``pump``) and a point-to-point message (``p2p``) fail for the same reasons, worded
the same way: this rank aborted or destroyed the group; a peer aborted it (its ABORT frame); a
peer's stream is out of step; a peer closed, reset or left (``peer_lost``).
"""

from __future__ import annotations

from ringlet.errors import (
    CollectiveMismatchError,
    DistBackendError,
    GroupAbortedError,
    PeerFailureError,
    abort_error_class,
)
from ringlet.transport.base import OpContext
from ringlet.transport.tcp.inbox import Inbox
from ringlet.transport.tcp.mesh import Peer
from ringlet.transport.tcp.outbox import Outbox

__all__ = ["local_trouble", "peer_lost", "peer_trouble"]

_EOF_WORDS = "closed the connection: it died, exited or was killed"


def peer_lost(ctx: OpContext, p: Peer, err: BaseException | None,
              kind: str = "collective") -> DistBackendError:
    """PeerFailureError for a peer whose connection ended (EOF, reset, BYE)."""
    gone = p.gone or ""
    if gone == "bye":
        what = "left the group (destroy_process_group or exit) before joining this operation"
    elif err is not None:
        what = (f"reset the connection ({type(err).__name__}: {err}) during a {kind} operation: "
                "it died or was killed")
    elif gone.startswith("reset"):
        what = f"{gone[:5]} the connection{gone[5:]}: it died or was killed"
    elif gone in ("", "eof"):
        what = _EOF_WORDS
    else:
        what = f"cannot be read from ({gone})"
    return ctx.error(PeerFailureError, f"rank {p.rank} ({p.where()}) {what}", peer=p.rank,
                     host=p.host, pid=p.pid)


def local_trouble(ctx: OpContext, outbox: Outbox) -> DistBackendError | None:
    """This rank destroyed or aborted the transport (None: neither)."""
    if outbox.closed:
        return ctx.error(GroupAbortedError,
                         f"the group was destroyed on this rank while this {ctx.op} waited")
    if outbox.aborted is not None:
        return ctx.error(GroupAbortedError, f"the group was aborted on this rank: {outbox.aborted}")
    return None


def peer_trouble(ctx: OpContext, inbox: Inbox, p: Peer, kind: str = "collective",
                 gone_matters: bool = True) -> DistBackendError | None:
    """Peer ``p`` aborted the group, or its stream is out of step, or (``gone_matters``) its
    connection ended (None: none of these)."""
    reason = inbox.aborted_by.get(p.rank)
    if reason is not None:
        return ctx.error(abort_error_class(reason),     # [Note: abort carries the cause]
                         f"the group was aborted by rank {p.rank} ({p.where()}): {reason}",
                         aborted_by=p.rank, peer=p.rank)
    if p.rank in inbox.desync:
        return ctx.error(CollectiveMismatchError, f"the stream from rank {p.rank} ({p.where()}) is "
                         "out of step after an earlier error", peer=p.rank)
    if gone_matters and p.gone is not None:
        return peer_lost(ctx, p, None, kind)
    return None
