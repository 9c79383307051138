"""The ``tcp`` transport: ranks anywhere, one authenticated connection per pair of ranks.

The parts, in the order bytes meet them (see ``transport.py`` for how they fit together):

- ``wire`` / ``mesh``: frame headers and the handshake
  ([Note: tcp frames], [Note: tcp handshake]); making the connections;
- ``inbox``: the receiving side -- one reader at a time, every frame routed to its owner
  ([Note: tcp routing]); ``frames``: what it tracks per frame and stream;
- ``outbox``: the sending side -- whole frames under a send lock, ABORT and BYE;
- ``pump``: one collective's sends and receives, bounded by its deadline (optionally received by
  the reader thread while the caller reduces: [Note: tcp I/O overlap]); ``faults``: why an
  operation cannot go on;
- ``algos``: which algorithm each collective runs ([Note: tcp reduction order]), from the
  families ``ring`` and ``direct``; ``p2p``: point-to-point messages;
- ``transport``: :class:`TcpTransport`, which wires the parts together.
"""

from ringlet.transport.tcp.transport import TcpTransport, choose_address

__all__ = ["TcpTransport", "choose_address"]
