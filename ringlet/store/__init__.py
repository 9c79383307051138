"""Key-value stores for rendezvous: ``TCPStore``, ``FileStore``, ``HashStore``, ``PrefixStore``."""

from ringlet.store.base import Store
from ringlet.store.file import FileStore
from ringlet.store.hash import HashStore
from ringlet.store.prefix import PrefixStore
from ringlet.store.tcp import TCPStore

__all__ = ["FileStore", "HashStore", "PrefixStore", "Store", "TCPStore"]
