"""``ringlet.distributed.elastic.multiprocessing.errors``: ``record`` at torch's path
(implemented in ``ringlet.launcher.errors``)."""

from ringlet.launcher.errors import ErrorHandler, get_error_handler, record

__all__ = ["ErrorHandler", "get_error_handler", "record"]
