"""ringlet's ``Store`` interface over the torch store that torch hands a backend's creator.

torch gives each group's creator a ``torch.distributed.PrefixStore`` (one namespace per group and
device).  ringlet's rendezvous and transports speak ringlet's :class:`~ringlet.store.base.Store`;
this adapter forwards each call and turns torch's store errors into ringlet's
:class:`~ringlet.errors.DistStoreError`, naming the key, so a peer that never arrives is reported
the way ringlet reports it everywhere else.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ringlet.errors import DistStoreError
from ringlet.store.base import Store, check_key, check_keys, check_pairs, to_bytes

__all__ = ["TorchStore", "torch_facing"]


class TorchStore(Store):
    """A torch ``Store`` (any of torch's kinds) seen through ringlet's interface.

    Args:
        store: the torch store.
        timeout: deadline of ``get``/``wait`` (torch's group timeout).

    Example::

        ts = TorchStore(torch.distributed.HashStore(), timedelta(seconds=30))
        ts.set("k", b"v"); assert ts.get("k") == b"v"
    """

    def __init__(self, store: Any, timeout: timedelta) -> None:
        super().__init__(timeout)
        self._s = store

    def __repr__(self) -> str:
        return f"TorchStore({type(self._s).__name__}, timeout={self._timeout_s:g}s)"

    def _fail(self, what: str, keys: list[str], err: BaseException) -> DistStoreError:
        return DistStoreError(f"torch store {what} {keys}: {err}", keys=keys)

    def set(self, key: str, value: str | bytes) -> None:
        self._s.set(check_key(key), to_bytes(value))

    def get(self, key: str) -> bytes:
        key = check_key(key)
        try:
            self._s.wait([key], self.timeout)
            return bytes(self._s.get(key))
        except RuntimeError as e:
            raise self._fail("get", [key], e) from None

    def add(self, key: str, amount: int) -> int:
        return int(self._s.add(check_key(key), int(amount)))

    def compare_set(self, key: str, expected_value: str | bytes,
                    desired_value: str | bytes) -> bytes:
        return bytes(self._s.compare_set(check_key(key), to_bytes(expected_value),
                                         to_bytes(desired_value)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = check_keys(keys)
        try:
            self._s.wait(keys, timedelta(seconds=self._wait_seconds(timeout)))
        except RuntimeError as e:
            raise self._fail("wait", keys, e) from None

    def check(self, keys: list[str]) -> bool:
        return bool(self._s.check(check_keys(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._s.delete_key(check_key(key)))

    def num_keys(self) -> int:
        return int(self._s.num_keys())

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = check_keys(keys)
        self.wait(keys)
        return [bytes(v) for v in self._s.multi_get(keys)]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        ks, vs = check_pairs(keys, values)
        self._s.multi_set(ks, vs)

    def append(self, key: str, value: str | bytes) -> None:
        self._s.append(check_key(key), to_bytes(value))

    def queue_push(self, key: str, value: str | bytes) -> None:
        self._s.queue_push(check_key(key), to_bytes(value))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        return bytes(self._s.queue_pop(check_key(key), block))

    def queue_len(self, key: str) -> int:
        return int(self._s.queue_len(check_key(key)))

    def list_keys(self) -> list[str]:
        return list(self._s.list_keys())

    def clone(self) -> TorchStore:
        return TorchStore(self._s.clone(), self.timeout)


def torch_facing(store: Any) -> Any:
    """A torch ``Store`` (a Python subclass torch accepts wherever it takes a store) over one of
    ringlet's stores: how a torch program launched by ``ringlet-run --torch-backend`` reaches the
    launcher's store, whose protocol torch's own ``TCPStore`` client does not speak."""
    import torch.distributed as tdist

    class RingletStoreForTorch(tdist.Store):
        """torch's ``Store`` interface over ringlet's ``{inner!r}``."""

        def __init__(self, inner: Any) -> None:
            super().__init__()
            self.inner = inner

        def __repr__(self) -> str:
            return f"RingletStoreForTorch({self.inner!r})"

        def set(self, key: str, value: Any) -> None:
            self.inner.set(key, value if isinstance(value, str) else bytes(value))

        def get(self, key: str) -> bytes:
            return self.inner.get(key)

        def add(self, key: str, amount: int) -> int:
            return self.inner.add(key, amount)

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            return self.inner.compare_set(key, expected, desired)

        def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
            self.inner.wait(keys, timeout)

        def check(self, keys: list[str]) -> bool:
            return self.inner.check(keys)

        def delete_key(self, key: str) -> bool:
            return self.inner.delete_key(key)

        def num_keys(self) -> int:
            return self.inner.num_keys()

        def set_timeout(self, timeout: timedelta) -> None:
            self.inner.set_timeout(timeout)

    return RingletStoreForTorch(store)
