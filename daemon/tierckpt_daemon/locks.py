"""A lock per key that is dropped once no one holds or waits for it: single flight per step
(the ranks of a node all ask for the same step at once) without a dict that grows with every
step ever asked for."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class KeyedLocks:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        # key -> (its lock, how many callers hold it or wait for it)
        self._locks: dict[Hashable, tuple[threading.Lock, int]] = {}

    @contextmanager
    def held(self, key: Hashable) -> Iterator[None]:
        """Hold ``key``'s lock: callers with the same key run one at a time."""
        with self._guard:
            lock, users = self._locks.get(key, (None, 0))
            if lock is None:
                lock = threading.Lock()
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                _, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)
