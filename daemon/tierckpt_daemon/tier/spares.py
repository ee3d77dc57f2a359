"""Spare files: a file of each leased size pre-faulted in the background for the next save.

While a namespace ramps up to ``keep_last`` committed steps nothing is evicted yet, so no file
comes back to the pool for the next save to recycle, and faulting in new tmpfs pages is the one
slow part of a lease. After a pre-faulted lease, a spare of its size is allocated in the pool by a
background thread, within the budget (against a reservation) and without evicting. A lease of a
size whose spare is still being faulted in waits for it (bounded), as the spare is further along
than a new file would be.

Not thread-safe by itself: every method but the background thread's runs under the lock it
shares with :class:`~tierckpt_daemon.tier.leases.Leases` (:class:`TierService`'s).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

from tierckpt_core.errors import CapacityExceededError
from tierckpt_daemon.tier.arena import Arena
from tierckpt_daemon.tier.index import StepIndex

logger = logging.getLogger(__name__)

SPARE_MIN_BYTES = 1 << 20
SPARE_WAIT_S = 60.0


class Spares:
    def __init__(
        self,
        arena: Arena,
        index: StepIndex,
        lock: threading.RLock,
        *,
        keep_last: int,
        enabled: bool,
    ) -> None:
        self.arena = arena
        self.index = index
        self.keep_last = keep_last
        self.enabled = enabled
        self._lock = lock
        self._in_flight: set[int] = set()
        self._done = threading.Condition(lock)

    def wait_for(self, size: int) -> None:
        """Under the lock: while a spare of ``size`` is being faulted in and none is pooled, wait
        for it (at most ``SPARE_WAIT_S``)."""
        deadline = time.monotonic() + SPARE_WAIT_S
        while size in self._in_flight and not self.arena.has_pooled(size):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._done.wait(left)

    def maybe_make(self, namespace: str, size: int) -> None:
        """Under the lock: start faulting in a spare of ``size`` for ``namespace``'s next save if
        it is still ramping up, none is pooled or on its way, and it fits without evicting."""
        if (
            not self.enabled
            or size < SPARE_MIN_BYTES
            or size in self._in_flight
            or self.arena.has_pooled(size)
            or len(self.index.committed.get(namespace, {})) >= self.keep_last
            or self.arena.capacity_bytes - self.arena.used_bytes < size
        ):
            return
        self.arena.reserve(size)
        self._in_flight.add(size)
        threading.Thread(
            target=self._make, args=(size,), name="tierckpt-prefault", daemon=True
        ).start()

    def _make(self, size: int) -> None:
        path = self.arena.pool_dir / f"{uuid.uuid4().hex}.bin"
        made = False
        try:
            self.arena.allocate(path, size)
            made = True
        except CapacityExceededError as e:
            logger.warning("could not pre-fault a spare file of %d bytes: %s", size, e)
        finally:
            with self._lock:
                self.arena.unreserve(size)
                self._in_flight.discard(size)
                if made:
                    self.arena.add_to_pool(path, size)
                self._done.notify_all()
