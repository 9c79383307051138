"""``ringlet.distributed.elastic.multiprocessing`` (torch's path); see ``.errors``."""
