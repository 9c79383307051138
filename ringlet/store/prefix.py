"""``PrefixStore``: a namespace inside another store (one per group, run or generation)."""

from __future__ import annotations

from datetime import timedelta

from ringlet.store.base import Store, check_key, check_keys

__all__ = ["PrefixStore"]


class PrefixStore(Store):
    """Every key ``k`` is stored as ``prefix + "/" + k`` in ``store``.

    Two prefix stores with different prefixes over one store never see each
    other's keys; ``num_keys`` counts the whole underlying store, like torch.

    Args:
        prefix: the namespace, e.g. ``"pg1"``.
        store: the store that really holds the keys (``underlying_store``).

    Raises:
        TypeError: ``prefix`` is not a ``str`` or ``store`` not a ``Store``.

    Example::

        base = HashStore()
        PrefixStore("a", base).set("x", b"1")
        assert base.get("a/x") == b"1"
    """

    def __init__(self, prefix: str, store: Store) -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"PrefixStore prefix: expected str, got {type(prefix).__name__}")
        if not isinstance(store, Store):
            raise TypeError(f"PrefixStore store: expected a Store, got {type(store).__name__}")
        # No super().__init__(): the timeout lives in the underlying store, and every
        # method that would read it is overridden to delegate.
        self._prefix = prefix
        self._store = store

    @property
    def underlying_store(self) -> Store:
        """The store that holds the prefixed keys."""
        return self._store

    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def timeout(self) -> timedelta:
        return self._store.timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._store.set_timeout(timeout)

    def __repr__(self) -> str:
        return f"PrefixStore({self._prefix!r}, {self._store!r})"

    def _key(self, key: str) -> str:
        return f"{self._prefix}/{check_key(key)}"

    def _keys(self, keys: list[str]) -> list[str]:
        return [f"{self._prefix}/{k}" for k in check_keys(keys)]

    def set(self, key: str, value: str | bytes) -> None:
        self._store.set(self._key(key), value)

    def get(self, key: str) -> bytes:
        return self._store.get(self._key(key))

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._key(key), amount)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        return self._store.compare_set(self._key(key), expected_value, desired_value)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._store.wait(self._keys(keys), timeout)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(self._keys(keys))

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._key(key))

    def num_keys(self) -> int:
        return self._store.num_keys()

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._store.multi_get(self._keys(keys))

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._store.multi_set(self._keys(keys), values)

    def append(self, key: str, value: str | bytes) -> None:
        self._store.append(self._key(key), value)

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._store.queue_push(self._key(key), value)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return self._store.queue_pop(self._key(key), block)

    def queue_len(self, key: str) -> int:
        return self._store.queue_len(self._key(key))

    def list_keys(self) -> list[str]:
        """The keys of this namespace, without the prefix."""
        head = f"{self._prefix}/"
        return [k[len(head):] for k in self._store.list_keys() if k.startswith(head)]

    def clone(self) -> PrefixStore:
        """The same namespace over a clone of the underlying store."""
        return PrefixStore(self._prefix, self._store.clone())
