"""Arena files handed to trainers before they write (leases), the spare files prepared ahead of
them, and the room a new file needs.

A lease is a pre-faulted file under ``leases/``: recycled from the pool when a file of the size is
there (the steady state: the previous save's files came back when retention evicted its step),
else allocated fresh against a reservation, outside the lock, because faulting in new tmpfs pages
is the one slow thing here. While a namespace ramps up to ``keep_last`` committed steps nothing is
evicted yet, so a spare of each leased size is allocated in the background, within the budget and
without evicting, for the next save.

Not thread-safe by itself beyond what it needs: it shares :class:`TierService`'s lock.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path

from tierckpt_core.errors import CapacityExceededError, LeaseNotFoundError
from tierckpt_core.protocol import LeaseResponse, validate_namespace
from tierckpt_daemon.arena import Arena, round_up
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.metrics import Metrics
from tierckpt_daemon.step_index import StepIndex

logger = logging.getLogger(__name__)

SPARE_MIN_BYTES = 1 << 20
SPARE_WAIT_S = 60.0


class Lease:
    __slots__ = ("expires", "lease_id", "namespace", "path", "rank", "size")

    def __init__(self, lease_id: str, namespace: str, rank: int, path: Path, size: int, ttl: float):
        self.lease_id = lease_id
        self.namespace = namespace
        self.rank = rank
        self.path = path
        self.size = size
        self.expires = time.monotonic() + ttl


class Leases:
    def __init__(
        self,
        arena: Arena,
        index: StepIndex,
        metrics: Metrics,
        lock: threading.RLock,
        *,
        keep_last: int,
        ttl_s: float,
        spares: bool,
    ) -> None:
        self.arena = arena
        self.index = index
        self.metrics = metrics
        self.keep_last = keep_last
        self.ttl_s = ttl_s
        self.spares = spares
        self._lock = lock
        self._leases: dict[str, Lease] = {}
        self._spares_in_flight: set[int] = set()
        self._spare_done = threading.Condition(lock)

    @property
    def held_bytes(self) -> int:
        return sum(le.size for le in self._leases.values())

    def grant(self, namespace: str, rank: int, size: int, *, prefault: bool) -> LeaseResponse:
        validate_namespace(namespace)
        size = round_up(size)
        lease_id = uuid.uuid4().hex
        path = self.arena.lease_dir / f"{lease_id}.bin"
        with self._lock:
            # A spare of this size being faulted in is further along than a new file would be.
            deadline = time.monotonic() + SPARE_WAIT_S
            while size in self._spares_in_flight and not self.arena.has_pooled(size):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._spare_done.wait(left)
            if self.arena.take_from_pool(size, path):
                if prefault:
                    self._maybe_spare(namespace, size)
                return self._grant(lease_id, namespace, rank, path, size, recycled=True)
            self._make_room(size, namespace)
            self.arena.reserve(size)
        try:
            self.arena.allocate(path, size, prefault=prefault)
        finally:
            with self._lock:
                self.arena.unreserve(size)
        with self._lock:
            self.arena.track(path, size)
            if prefault:
                self._maybe_spare(namespace, size)
            return self._grant(lease_id, namespace, rank, path, size, recycled=False)

    def _grant(
        self, lease_id: str, namespace: str, rank: int, path: Path, size: int, *, recycled: bool
    ) -> LeaseResponse:
        self._leases[lease_id] = Lease(lease_id, namespace, rank, path, size, self.ttl_s)
        logger.debug(
            "lease %s: %s rank %d, %d bytes, recycled=%s",
            lease_id,
            namespace,
            rank,
            size,
            recycled,
            extra=step_fields(namespace, rank=rank),
        )
        return LeaseResponse(
            lease_id=lease_id, path=str(path), size=size, recycled=recycled, expires_in_s=self.ttl_s
        )

    def get(self, namespace: str, lease_id: str) -> Lease | None:
        lease = self._leases.get(lease_id)
        return lease if lease is not None and lease.namespace == namespace else None

    def take(self, lease: Lease) -> None:
        """The lease's file now belongs to a step (it was sealed)."""
        del self._leases[lease.lease_id]

    def release(self, namespace: str, lease_id: str) -> None:
        with self._lock:
            lease = self.get(namespace, lease_id)
            if lease is None:
                raise LeaseNotFoundError(f"namespace {namespace}: no lease {lease_id}")
            del self._leases[lease_id]
            self.arena.adopt_into_pool(lease.path)

    def expire(self, now: float) -> None:
        for lease in [le for le in self._leases.values() if le.expires < now]:
            logger.warning(
                "lease %s of %s rank %d expired unsealed; reclaiming %d bytes",
                lease.lease_id,
                lease.namespace,
                lease.rank,
                lease.size,
                extra=step_fields(lease.namespace, rank=lease.rank),
            )
            del self._leases[lease.lease_id]
            self.arena.adopt_into_pool(lease.path)

    # -- spares -----------------------------------------------------------------------------
    def _maybe_spare(self, namespace: str, size: int) -> None:
        if (
            not self.spares
            or size < SPARE_MIN_BYTES
            or size in self._spares_in_flight
            or self.arena.has_pooled(size)
            or len(self.index.committed.get(namespace, {})) >= self.keep_last
            or self.arena.capacity_bytes - self.arena.used_bytes < size
        ):
            return
        self.arena.reserve(size)
        self._spares_in_flight.add(size)
        threading.Thread(
            target=self._make_spare, args=(size,), name="tierckpt-prefault", daemon=True
        ).start()

    def _make_spare(self, size: int) -> None:
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
                self._spares_in_flight.discard(size)
                if made:
                    self.arena.add_to_pool(path, size)
                self._spare_done.notify_all()

    # -- room -------------------------------------------------------------------------------
    def _make_room(self, size: int, namespace: str) -> None:
        """Free pool files, then evict safe committed steps, until ``size`` more bytes fit."""
        arena = self.arena
        if arena.capacity_bytes - arena.used_bytes >= size:
            return
        # Evict nothing for a request that cannot fit even with everything evictable gone.
        evictable = sum(
            r.bytes
            for steps in self.index.committed.values()
            for r in self.index.policy.under_pressure(list(steps.values()))
        )
        if arena.capacity_bytes - arena.used_bytes + arena.pool_bytes + evictable < size:
            self.metrics.capacity_rejections.inc()
            raise CapacityExceededError(
                f"namespace {namespace}: a lease of {size} bytes does not fit in the memory tier "
                f"even with every evictable step gone (capacity {arena.capacity_bytes} bytes, of "
                f"which {arena.used_bytes} in use and {arena.pool_bytes + evictable} could be "
                "freed), so nothing was evicted. Raise TIERCKPT_CAPACITY or save smaller files."
            )
        arena.trim_pool(size)
        while arena.capacity_bytes - arena.used_bytes < size:
            victim = self.index.pressure_victim()
            if victim is None:
                break
            logger.warning(
                "memory tier full: evicting committed step %s/%d to make room for %d bytes",
                victim.namespace,
                victim.step,
                size,
            )
            self.index.evict(victim, to_pool=False)
            self.metrics.evictions.labels(reason="pressure").inc()
        if arena.capacity_bytes - arena.used_bytes < size:
            self.metrics.capacity_rejections.inc()
            writing = sum(r.bytes for r in self.index.writing.values()) + self.held_bytes
            committed = sum(r.bytes for r in self.index.all_committed())
            raise CapacityExceededError(
                f"namespace {namespace}: a lease of {size} bytes does not fit in the memory tier "
                f"(capacity {arena.capacity_bytes} bytes; in use: {committed} committed and kept, "
                f"{writing} being written, {arena.pool_bytes} pooled). Nothing more can be evicted "
                "safely: the newest committed step of each namespace and steps being read are kept. "
                "Raise TIERCKPT_CAPACITY, lower TIERCKPT_KEEP_LAST, or delete steps."
            )
