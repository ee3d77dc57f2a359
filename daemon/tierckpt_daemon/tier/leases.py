"""Arena files handed to trainers before they write (leases), and the room a new file needs.

A lease is a pre-faulted file under ``leases/``: recycled from the pool when a file of the size is
there (the steady state: the previous save's files came back when retention evicted its step),
else allocated fresh against a reservation, outside the lock, because faulting in new tmpfs pages
is the one slow thing here. While a namespace ramps up, a spare of each leased size is pre-faulted
in the background for the next save (:mod:`tierckpt_daemon.tier.spares`).

**Pre-leases** take the lease round trip out of the trainer's stall: after sealing its file, a
rank asks for its next save's file ``after`` the save attempt commits. The daemon names the file
now and, when that attempt commits, moves a file the commit freed (the pool) to that path: never a
new allocation, never an eviction; no file of the size, no pre-lease (the rank then leases as
before). The next save claims it without asking: it opens the path and takes ``flock(LOCK_EX |
LOCK_NB)`` on it, holding the lock until the file is sealed. A pre-lease counts against the budget
like any lease, but the daemon takes back any it can lock (one nobody has claimed): under memory
pressure before evicting a committed step, and when it expires (a dead trainer's lock is gone with
its process; a claimed one is renewed once when its TTL runs out, as a plain lease granted at the
claim would live that long).

Not thread-safe by itself beyond what it needs: it shares :class:`TierService`'s lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
import uuid
from pathlib import Path

from tierckpt_core.errors import CapacityExceededError, LeaseNotFoundError
from tierckpt_core.protocol import (
    LeaseResponse,
    validate_file_name,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.metrics import Metrics
from tierckpt_daemon.tier.arena import Arena, round_up
from tierckpt_daemon.tier.index import StepIndex
from tierckpt_daemon.tier.spares import Spares

logger = logging.getLogger(__name__)


class Lease:
    __slots__ = (
        "expires",
        "lease_id",
        "namespace",
        "owner",
        "path",
        "pre",
        "rank",
        "renewed",
        "size",
    )

    def __init__(
        self,
        lease_id: str,
        namespace: str,
        rank: int,
        path: Path,
        size: int,
        ttl: float,
        *,
        pre: bool = False,
        owner: str | None = None,
    ):
        self.lease_id = lease_id
        self.namespace = namespace
        self.rank = rank
        self.path = path
        self.size = size
        # The identity that took it (None: the daemon's own, e.g. a hydration): until the
        # namespace's first seal here claims it, the namespace has no owner, and the lease ids
        # can be read off the tier directory, so the lease itself says who may seal or release it.
        self.owner = owner
        self.expires = time.monotonic() + ttl
        self.pre = pre  # a pre-lease: taken back when nobody holds its flock
        self.renewed = False


class Ahead:
    """A pre-lease asked for, granted when its save attempt commits."""

    __slots__ = (
        "attempt",
        "expires",
        "lease_id",
        "namespace",
        "owner",
        "path",
        "rank",
        "size",
        "step",
    )

    def __init__(
        self,
        lease_id: str,
        namespace: str,
        rank: int,
        path: Path,
        size: int,
        step: int,
        attempt: str,
        owner: str | None = None,
    ) -> None:
        self.owner = owner
        self.lease_id = lease_id
        self.namespace = namespace
        self.rank = rank
        self.path = path
        self.size = size
        self.step = step
        self.attempt = attempt
        self.expires = 0.0


def _lock_if_unclaimed(path: Path) -> int | None:
    """An open descriptor holding ``flock(LOCK_EX)`` on ``path`` if no trainer holds it; -1 if
    there is no regular file at ``path`` (nothing to lock); None while a trainer holds it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:  # gone, or a link planted in the tier directory (adopt_into_pool removes it)
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


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
        self.ttl_s = ttl_s
        self.spares = Spares(arena, index, lock, keep_last=keep_last, enabled=spares)
        self._lock = lock
        self._leases: dict[str, Lease] = {}
        self._ahead: dict[str, Ahead] = {}  # pre-leases waiting for their attempt's commit

    @property
    def held_bytes(self) -> int:
        return sum(le.size for le in self._leases.values())

    def grant(
        self, namespace: str, rank: int, size: int, *, prefault: bool, owner: str | None = None
    ) -> LeaseResponse:
        validate_namespace(namespace)
        size = round_up(size)
        lease_id = uuid.uuid4().hex
        path = self.arena.lease_dir / f"{lease_id}.bin"
        with self._lock:
            self.spares.wait_for(size)
            if self.arena.take_from_pool(size, path, (namespace, rank)):
                if prefault:
                    self.spares.maybe_make(namespace, size)
                return self._grant(
                    lease_id, namespace, rank, path, size, recycled=True, owner=owner
                )
            self._make_room(size, namespace)
            self.arena.reserve(size)
        try:
            self.arena.allocate(path, size, prefault=prefault)
        except CapacityExceededError:  # ENOSPC: the tmpfs is smaller than TIERCKPT_CAPACITY
            self.metrics.capacity_rejections.inc()
            raise
        finally:
            with self._lock:
                self.arena.unreserve(size)
        with self._lock:
            self.arena.track(path, size)
            if prefault:
                self.spares.maybe_make(namespace, size)
            return self._grant(lease_id, namespace, rank, path, size, recycled=False, owner=owner)

    def _grant(
        self,
        lease_id: str,
        namespace: str,
        rank: int,
        path: Path,
        size: int,
        *,
        recycled: bool,
        owner: str | None,
    ) -> LeaseResponse:
        self._leases[lease_id] = Lease(
            lease_id, namespace, rank, path, size, self.ttl_s, owner=owner
        )
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

    # -- pre-leases -------------------------------------------------------------------------
    def ask_ahead(
        self,
        namespace: str,
        rank: int,
        size: int,
        step: int,
        attempt: str,
        owner: str | None = None,
    ) -> LeaseResponse:
        """Name a file for ``rank``'s next save, put in place when ``attempt`` commits (at once
        if it already has, from the pool; never for an attempt that was aborted or is unknown
        here: the request may come after the attempt ended, as the trainer asks beside its
        commit)."""
        validate_namespace(namespace)
        validate_step(step)
        validate_file_name(attempt)
        size = round_up(size)
        lease_id = uuid.uuid4().hex
        ahead = Ahead(
            lease_id,
            namespace,
            rank,
            self.arena.lease_dir / f"{lease_id}.bin",
            size,
            step,
            attempt,
            owner,
        )
        with self._lock:
            ahead.expires = time.monotonic() + self.ttl_s
            done = self.index.committed.get(namespace, {}).get(step)
            if (namespace, step, attempt) in self.index.writing:
                self._ahead[lease_id] = ahead
            elif done is not None and done.attempt == attempt:
                self._grant_ahead(ahead)
            else:
                logger.debug(
                    "pre-lease %s of %s rank %d: attempt %s of step %d is not being written "
                    "and not committed",
                    lease_id,
                    namespace,
                    rank,
                    attempt,
                    step,
                )
        return LeaseResponse(
            lease_id=lease_id,
            path=str(ahead.path),
            size=size,
            recycled=True,
            expires_in_s=self.ttl_s,
            pending=True,
        )

    def fulfil(self, namespace: str, step: int, attempt: str) -> None:
        """``attempt`` committed (and retention freed what it frees): grant its pre-leases."""
        with self._lock:
            for a in [a for a in self._ahead.values() if (a.step, a.attempt) == (step, attempt)]:
                if a.namespace == namespace:
                    del self._ahead[a.lease_id]
                    self._grant_ahead(a)

    def _grant_ahead(self, a: Ahead) -> None:
        # One pre-lease per rank: an older one its trainer never claimed goes back first.
        for old in [
            le
            for le in self._leases.values()
            if le.pre and (le.namespace, le.rank) == (a.namespace, a.rank)
        ]:
            self._take_back(old)
        if a.expires < time.monotonic() or not self.arena.take_from_pool(
            a.size, a.path, (a.namespace, a.rank)
        ):
            logger.debug(
                "pre-lease %s of %s rank %d: no file freed", a.lease_id, a.namespace, a.rank
            )
            return
        self._leases[a.lease_id] = Lease(
            a.lease_id, a.namespace, a.rank, a.path, a.size, self.ttl_s, pre=True, owner=a.owner
        )
        self.metrics.leases.labels(recycled="true").inc()
        self.metrics.leased_bytes.inc(a.size)

    def _take_back(self, lease: Lease, *, force: bool = False) -> bool:
        """Give a pre-lease's file back to the pool unless a trainer holds it (``force``: even
        then). False if it is held."""
        fd = _lock_if_unclaimed(lease.path)
        if fd is None and not force:
            return False
        try:
            del self._leases[lease.lease_id]
            self.arena.adopt_into_pool(lease.path, (lease.namespace, lease.rank))
        finally:
            if fd is not None and fd >= 0:
                os.close(fd)
        return True

    @property
    def pre_bytes(self) -> int:
        """Bytes of pre-leases (claimed or not): what pressure may take back."""
        return sum(le.size for le in self._leases.values() if le.pre)

    def take_back_for(self, size: int) -> None:
        """Under pressure: take back unclaimed pre-leases, oldest first, until ``size`` fits."""
        arena = self.arena
        for lease in sorted(
            (le for le in self._leases.values() if le.pre), key=lambda x: x.expires
        ):
            if arena.capacity_bytes - arena.used_bytes >= size:
                return
            if self._take_back(lease):
                logger.info(
                    "memory tier full: took back the unclaimed pre-lease of %s rank %d (%d bytes)",
                    lease.namespace,
                    lease.rank,
                    lease.size,
                    extra=step_fields(lease.namespace, rank=lease.rank),
                )
                arena.trim_pool(size)

    def get(
        self, namespace: str, lease_id: str, owner: str | None = None, *, admin: bool = False
    ) -> Lease | None:
        """The lease, if it is of ``namespace`` and (unless ``owner`` is None or ``admin``) the
        identity ``owner`` took it: another uid's lease is as unknown as a made-up id."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.namespace != namespace:
            return None
        if owner is not None and not admin and lease.owner not in (None, owner):
            return None
        return lease

    def take(self, lease: Lease) -> None:
        """The lease's file now belongs to a step (it was sealed)."""
        del self._leases[lease.lease_id]

    def release(
        self, namespace: str, lease_id: str, owner: str | None = None, *, admin: bool = False
    ) -> None:
        with self._lock:
            ahead = self._ahead.get(lease_id)
            if (
                ahead is not None
                and ahead.namespace == namespace
                and (owner is None or admin or ahead.owner in (None, owner))
            ):
                del self._ahead[lease_id]  # a pre-lease not granted yet: never will be
                return
            lease = self.get(namespace, lease_id, owner, admin=admin)
            if lease is None:
                raise LeaseNotFoundError(f"namespace {namespace}: no lease {lease_id}")
            del self._leases[lease_id]
            self.arena.adopt_into_pool(lease.path, (lease.namespace, lease.rank))

    def expire(self, now: float) -> None:
        for a in [a for a in self._ahead.values() if a.expires < now]:
            del self._ahead[a.lease_id]
        for lease in [le for le in self._leases.values() if le.expires < now and le.pre]:
            if self._take_back(lease, force=lease.renewed):
                logger.info(
                    "pre-lease %s of %s rank %d expired; reclaiming %d bytes",
                    lease.lease_id,
                    lease.namespace,
                    lease.rank,
                    lease.size,
                    extra=step_fields(lease.namespace, rank=lease.rank),
                )
            else:  # claimed by a live trainer: it lives as long as a lease granted now would
                lease.renewed = True
                lease.expires = now + self.ttl_s
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
            self.arena.adopt_into_pool(lease.path, (lease.namespace, lease.rank))

    # -- room -------------------------------------------------------------------------------
    def _make_room(self, size: int, namespace: str) -> None:
        """Free pool files, then evict safe committed steps, until ``size`` more bytes fit."""
        arena = self.arena
        if arena.capacity_bytes - arena.used_bytes >= size:
            return
        # Evict nothing for a request that cannot fit even with everything evictable gone.
        evictable = self.pre_bytes + sum(
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
        self.take_back_for(size)  # pre-leases nobody claimed, before any committed step
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
