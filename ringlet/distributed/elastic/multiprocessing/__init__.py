"""``ringlet.distributed.elastic.multiprocessing`` (torch's path); see ``.errors``."""

__all__: list[str] = []
