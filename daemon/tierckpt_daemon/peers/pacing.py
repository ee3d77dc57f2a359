"""Pacing of the bytes this daemon moves between peers, so that replication does not fill the
network the training job's collectives need (issue 32).

One :class:`TokenBucket` per purpose, shared by every transfer of the daemon: the replicas it
pulls for its ring predecessors (a "push" is the replica pulling, so the pushed bytes are paced
where they land, and TCP's flow control holds the sender to the same rate) and the files a restore
fetches from peers (a limit of its own: see docs/operations.md "Pacing replication"). A reader
reads at most the bucket's depth, then takes tokens for what it got, sleeping for any deficit:
over any interval t the daemon takes in at most ``rate * t + depth`` bytes per bucket, plus one
read (at most ``depth``) per stream reading at that moment, whose tokens it has yet to take.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

DEFAULT_DEPTH = 4 << 20  # bytes let through at once ahead of the rate (one read at most)


class TokenBucket:
    """``rate`` bytes per second on average, bursts of at most ``depth`` bytes; thread-safe.

    A taker books its bytes at once (the level may go negative: later takers wait behind it, in
    turn) and sleeps outside the lock until the rate has paid for them; every wait is at most
    ``(booked ahead + n) / rate``. ``clock`` and ``sleep`` are injectable for tests."""

    def __init__(
        self,
        rate: float,
        depth: int = DEFAULT_DEPTH,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not rate > 0:
            raise ValueError(f"a transfer rate must be > 0 bytes/s, got {rate}")
        if depth <= 0:
            raise ValueError(f"a bucket depth must be > 0 bytes, got {depth}")
        self.rate = float(rate)
        self.depth = int(depth)
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._level = float(depth)  # full: the first ``depth`` bytes go at once
        self._at = clock()

    def reserve(self, n: int) -> float:
        """Book ``n`` bytes (0 < n <= depth); the seconds to wait before they are paid for."""
        if not 0 < n <= self.depth:
            raise ValueError(f"take 1 to {self.depth} bytes at a time from the bucket, not {n}")
        with self._lock:
            now = self._clock()
            self._level = min(float(self.depth), self._level + (now - self._at) * self.rate)
            self._at = now
            self._level -= n
            return -self._level / self.rate if self._level < 0 else 0.0

    def take(self, n: int) -> None:
        """Book ``n`` bytes and wait until the rate has paid for them."""
        wait = self.reserve(n)
        if wait > 0:
            self._sleep(wait)


def paced_readinto(
    readinto: Callable[[memoryview], int], bucket: TokenBucket | None
) -> Callable[[memoryview], int]:
    """``readinto`` reading at most ``bucket.depth`` bytes a call and taking tokens for what it
    got (unchanged without a bucket)."""
    if bucket is None:
        return readinto
    depth = bucket.depth

    def read(view: memoryview) -> int:
        n = readinto(view[:depth] if len(view) > depth else view)
        if n:
            bucket.take(n)
        return n

    return read
