"""``ringlet.distributed.elastic``: torch's ``torch.distributed.elastic`` paths that scripts import.

``multiprocessing.errors.record`` (decorate ``main``) and :func:`heartbeat` (tell ``ringlet-run
--heartbeat-timeout`` that a long phase without communication is making progress).  The
implementation lives in ``ringlet.launcher``.
"""

from ringlet._heartbeat import beat as heartbeat

__all__ = ["heartbeat"]
