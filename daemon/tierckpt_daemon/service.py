"""The memory tier's operations: lease, seal, commit, pin, delete, evict, sweep, rebuild.

One :class:`TierService` per daemon. Every public method is safe to call from several threads: the
state is guarded by one lock, and the only slow operation (allocating fresh tmpfs pages for a new
file) runs outside it against a reservation.

Write path of one save attempt (one per ``dcp.save``/``async_save`` call)::

    lease(rank, size)          -> a pre-faulted file under leases/ (recycled from the pool if possible)
    seal(step, attempt, rank)  -> the rank's leased files move into the attempt's step directory
    commit(step, attempt)      -> every listed file is sealed: write MANIFEST.json, state COMMITTED,
                                  older attempts of the step and steps beyond retention are evicted

Evicted files go to the pool; the next lease of the same size takes them back (see store.py).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tierckpt_core.errors import (
    CapacityExceededError,
    CheckpointFormatError,
    LeaseNotFoundError,
    NamespaceNotFoundError,
    NotFoundError,
    PersistentTierError,
    StepNotFoundError,
    StepStateError,
)
from tierckpt_core.manifest import FileRecord
from tierckpt_core.protocol import (
    API_VERSION,
    CommitRequest,
    LeaseResponse,
    NamespaceInfo,
    PinResponse,
    SealRequest,
    StatusResponse,
    StepCandidate,
    StepInfo,
    StepState,
    validate_file_name,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon import __version__
from tierckpt_daemon.arena import Arena, round_up
from tierckpt_daemon.eviction import EvictionPolicy, KeepLatestN, safe_to_evict
from tierckpt_daemon.metrics import Metrics
from tierckpt_daemon.records import (
    StepRecord,
    parse_step_dir_name,
    read_manifest,
    record_from_manifest,
    step_dir_name,
    update_manifest,
    write_manifest,
)

if TYPE_CHECKING:
    from tierckpt_daemon.persist import Persister
    from tierckpt_daemon.replication import Replicator

logger = logging.getLogger(__name__)

PIN_TTL_S = 600.0
SPARE_MIN_BYTES = 1 << 20
SPARE_WAIT_S = 60.0
POOL_IDLE_S = 900.0


@dataclass(frozen=True)
class Snapshot:
    capacity_bytes: int
    bytes_by_state: dict[str, int]
    steps_by_state: dict[str, int]
    upload_queue: int
    persistent_healthy: bool | None
    replication_queue: int = 0


class _Lease:
    __slots__ = ("expires", "lease_id", "namespace", "path", "rank", "size")

    def __init__(self, lease_id: str, namespace: str, rank: int, path: Path, size: int, ttl: float):
        self.lease_id = lease_id
        self.namespace = namespace
        self.rank = rank
        self.path = path
        self.size = size
        self.expires = time.monotonic() + ttl


class TierService:
    def __init__(
        self,
        arena: Arena,
        *,
        keep_last: int = 2,
        lease_ttl_s: float = 900.0,
        policy: EvictionPolicy | None = None,
        spares: bool = True,
    ) -> None:
        self.arena = arena
        self.keep_last = keep_last
        self.lease_ttl_s = lease_ttl_s
        self.policy: EvictionPolicy = policy or KeepLatestN(keep_last)
        self._lock = threading.RLock()
        self._leases: dict[str, _Lease] = {}
        self._committed: dict[str, dict[int, StepRecord]] = {}
        self._writing: dict[tuple[str, int, str], StepRecord] = {}
        self._evicting: list[StepRecord] = []  # superseded or retired, waiting for readers to unpin
        self.persister: Persister | None = None  # set when a persistent tier is configured
        self.replicator: Replicator | None = None  # set when peers are configured
        self._hydrate_locks: dict[tuple[str, int], threading.Lock] = {}
        self.persist_every = 1
        self._commits_since_persist: dict[str, int] = {}
        self._spares_in_flight: set[int] = set()
        self._spare_done = threading.Condition(self._lock)
        self.metrics = Metrics()
        self.metrics.attach(self)
        self.spares = spares

    # -- start-up ---------------------------------------------------------------------------
    def rebuild(self) -> None:
        """Rebuild the index from the tier directory after a (re)start."""
        with self._lock:
            self.arena.scan_pool()
            reclaimed = 0
            for p in sorted(self.arena.lease_dir.iterdir()):
                self.arena.adopt_into_pool(p)
                reclaimed += 1
            for ns_dir in sorted(self.arena.ns_dir.iterdir()):
                for step_dir in sorted(ns_dir.iterdir()) if ns_dir.is_dir() else []:
                    reclaimed += self._rebuild_step(ns_dir.name, step_dir)
                if ns_dir.is_dir() and not any(ns_dir.iterdir()):
                    ns_dir.rmdir()
            for ns, steps in self._committed.items():
                # A crash between a commit and its retention leaves one step too many.
                for victim in self.policy.after_commit(list(steps.values())):
                    self._retire(victim)
                logger.info("namespace %s: committed steps %s", ns, sorted(steps))
            logger.info(
                "index rebuilt from %s: %d committed steps, %d partial files reclaimed, %d pool files",
                self.arena.root,
                sum(len(s) for s in self._committed.values()),
                reclaimed,
                self.arena.pool_files,
            )

    def _rebuild_step(self, namespace: str, step_dir: Path) -> int:
        manifest = step_dir / "MANIFEST.json"
        if step_dir.is_dir() and manifest.exists() and parse_step_dir_name(step_dir.name):
            try:
                rec = record_from_manifest(namespace, step_dir, read_manifest(manifest))
            except CheckpointFormatError as e:
                logger.warning("discarding step directory %s: %s", step_dir, e)
            else:
                for f in rec.files.values():
                    self.arena.track(step_dir / f.name, f.held_bytes)
                steps = self._committed.setdefault(namespace, {})
                old = steps.get(rec.step)
                # Two committed attempts of one step survive a crash mid-supersede: newest wins.
                if old is None or (old.committed_at or 0) < (rec.committed_at or 0):
                    steps[rec.step] = rec
                    if old is not None:
                        self._drop(old)
                else:
                    self._drop(rec)
                return 0
        n = self._reclaim_dir(step_dir)
        logger.info("reclaimed %d files of unfinished save %s/%s", n, namespace, step_dir.name)
        return n

    def _reclaim_dir(self, step_dir: Path) -> int:
        n = 0
        if step_dir.is_dir():
            for p in list(step_dir.iterdir()):
                if p.name.startswith("MANIFEST"):
                    p.unlink()
                else:
                    self.arena.adopt_into_pool(p)
                    n += 1
            step_dir.rmdir()
        else:
            step_dir.unlink(missing_ok=True)
        return n

    # -- leases -----------------------------------------------------------------------------
    def lease(
        self, namespace: str, rank: int, size: int, *, prefault: bool = True
    ) -> LeaseResponse:
        """A file of ``size`` bytes for ``rank``. ``prefault=False`` (a download will write every
        byte anyway) neither zero-fills new pages nor prepares a spare."""
        with self.metrics.lease_seconds.time():
            lease = self._lease(namespace, rank, size, prefault)
        self.metrics.leases.labels(recycled=str(lease.recycled).lower()).inc()
        self.metrics.leased_bytes.inc(lease.size)
        return lease

    def _lease(self, namespace: str, rank: int, size: int, prefault: bool) -> LeaseResponse:
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

    def _maybe_spare(self, namespace: str, size: int) -> None:
        """While a namespace ramps up to ``keep_last`` committed steps, nothing is evicted into the
        pool yet, so the next save of this size would get fresh pages. Allocate and fault in a
        spare file of this size in the background now, within the budget and without evicting."""
        if (
            not self.spares
            or size < SPARE_MIN_BYTES
            or size in self._spares_in_flight
            or self.arena.has_pooled(size)
            or len(self._committed.get(namespace, {})) >= self.keep_last
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

    def _grant(
        self, lease_id: str, namespace: str, rank: int, path: Path, size: int, *, recycled: bool
    ) -> LeaseResponse:
        self._leases[lease_id] = _Lease(lease_id, namespace, rank, path, size, self.lease_ttl_s)
        logger.debug(
            "lease %s: %s rank %d, %d bytes, recycled=%s", lease_id, namespace, rank, size, recycled
        )
        return LeaseResponse(
            lease_id=lease_id,
            path=str(path),
            size=size,
            recycled=recycled,
            expires_in_s=self.lease_ttl_s,
        )

    def _make_room(self, size: int, namespace: str) -> None:
        """Free pool files, then evict safe committed steps, until ``size`` more bytes fit."""
        arena = self.arena
        if arena.capacity_bytes - arena.used_bytes >= size:
            return
        arena.trim_pool(size)
        while arena.capacity_bytes - arena.used_bytes < size:
            victim = self._pressure_victim()
            if victim is None:
                break
            logger.warning(
                "memory tier full: evicting committed step %s/%d to make room for %d bytes",
                victim.namespace,
                victim.step,
                size,
            )
            self._evict(victim, to_pool=False)
            self.metrics.evictions.labels(reason="pressure").inc()
        if arena.capacity_bytes - arena.used_bytes < size:
            self.metrics.capacity_rejections.inc()
            writing = sum(r.bytes for r in self._writing.values()) + sum(
                le.size for le in self._leases.values()
            )
            committed = sum(r.bytes for s in self._committed.values() for r in s.values())
            raise CapacityExceededError(
                f"namespace {namespace}: a lease of {size} bytes does not fit in the memory tier "
                f"(capacity {arena.capacity_bytes} bytes; in use: {committed} committed and kept, "
                f"{writing} being written, {arena.pool_bytes} pooled). Nothing more can be evicted "
                "safely: the newest committed step of each namespace and steps being read are kept. "
                "Raise TIERCKPT_CAPACITY, lower TIERCKPT_KEEP_LAST, or delete steps."
            )

    def _pressure_victim(self) -> StepRecord | None:
        candidates: list[StepRecord] = []
        for steps in self._committed.values():
            candidates.extend(self.policy.under_pressure(list(steps.values())))
        candidates.sort(key=lambda r: r.committed_at or 0)
        return candidates[0] if candidates else None

    def release_lease(self, namespace: str, lease_id: str) -> None:
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.namespace != namespace:
                raise LeaseNotFoundError(f"namespace {namespace}: no lease {lease_id}")
            del self._leases[lease_id]
            self.arena.adopt_into_pool(lease.path)

    # -- seal and commit --------------------------------------------------------------------
    def seal(self, namespace: str, step: int, attempt: str, req: SealRequest) -> StepInfo:
        validate_namespace(namespace)
        validate_step(step)
        validate_file_name(attempt)
        with self._lock:
            key = (namespace, step, attempt)
            rec = self._writing.get(key)
            if rec is None:
                self._discard_stale_attempts(namespace, step)
                step_dir = self.arena.ns_dir / namespace / step_dir_name(step, attempt)
                step_dir.mkdir(parents=True, exist_ok=False)
                rec = StepRecord(namespace=namespace, step=step, attempt=attempt, dir=step_dir)
                self._writing[key] = rec
            for f in req.files:
                validate_file_name(f.name)
                if f.name.startswith("MANIFEST"):
                    raise StepStateError(f"file name {f.name!r} is reserved")
                lease = self._leases.get(f.lease_id)
                if lease is None or lease.namespace != namespace:
                    raise LeaseNotFoundError(
                        f"{namespace}/step {step} rank {req.rank}: lease {f.lease_id} for file "
                        f"{f.name} is unknown or expired (was the daemon restarted during the save?)"
                    )
                if f.name in rec.files:
                    raise StepStateError(
                        f"{namespace}/step {step}: file {f.name} was already sealed by rank "
                        f"{rec.files[f.name].rank}"
                    )
                if f.length > lease.size:
                    raise StepStateError(
                        f"{namespace}/step {step}: file {f.name} claims {f.length} bytes but its "
                        f"lease holds {lease.size}"
                    )
                del self._leases[f.lease_id]
                self.arena.move(lease.path, rec.dir / f.name)
                rec.files[f.name] = FileRecord(
                    name=f.name, rank=req.rank, size=lease.size, length=f.length
                )
            rec.last_activity = time.monotonic()
            return rec.info()

    def _discard_stale_attempts(self, namespace: str, step: int) -> None:
        for key in [k for k in self._writing if k[0] == namespace and k[1] == step]:
            old = self._writing.pop(key)
            logger.warning(
                "%s/step %d: discarding unfinished save attempt %s, a new attempt started",
                namespace,
                step,
                old.attempt,
            )
            self._reclaim_dir(old.dir)

    def commit(
        self,
        namespace: str,
        step: int,
        attempt: str,
        req: CommitRequest,
        *,
        replicate: bool = True,
        origin: str | None = None,
        checksums: dict[str, str] | None = None,
    ) -> StepInfo:
        """Commit a save attempt. ``replicate=False`` (a step hydrated from the persistent tier)
        and ``origin`` (a replica received from that peer) keep it from being pushed to peers;
        ``checksums`` are the files' checksums when already known."""
        with self.metrics.commit_seconds.time():
            info = self._commit(namespace, step, attempt, req, replicate, origin, checksums)
        self.metrics.commits.inc()
        return info

    def _commit(
        self,
        namespace: str,
        step: int,
        attempt: str,
        req: CommitRequest,
        replicate: bool,
        origin: str | None,
        checksums: dict[str, str] | None,
    ) -> StepInfo:
        validate_namespace(namespace)
        validate_step(step)
        with self._lock:
            rec = self._writing.get((namespace, step, attempt))
            if rec is None:
                raise StepNotFoundError(
                    f"{namespace}/step {step}: no save in progress with attempt {attempt} (it "
                    "expired, was superseded, or the daemon restarted during the save)"
                )
            missing = sorted(set(req.files) - set(rec.files))
            if missing:
                raise StepStateError(
                    f"{namespace}/step {step}: cannot commit, {len(missing)} files were never "
                    f"sealed: {', '.join(missing[:8])}"
                )
            for name in sorted(set(rec.files) - set(req.files)):
                self.arena.adopt_into_pool(rec.dir / name)
                del rec.files[name]
            rec.world_size = req.world_size
            rec.persist = req.persist
            rec.persist_pending = self._wants_persist(namespace, step, req.persist)
            rec.origin = origin
            rec.learn_checksums(checksums or {})
            rec.replication_pending = (
                replicate
                and origin is None
                and self.replicator is not None
                and self.replicator.replicas > 0
            )
            rec.committed_at = time.time()
            write_manifest(rec, req.metadata)
            rec.state = StepState.COMMITTED
            del self._writing[(namespace, step, attempt)]
            steps = self._committed.setdefault(namespace, {})
            old = steps.get(step)
            steps[step] = rec
            if old is not None:
                logger.info(
                    "%s/step %d: new commit supersedes attempt %s", namespace, step, old.attempt
                )
                self._retire(old)
                self.metrics.evictions.labels(reason="superseded").inc()
            for victim in self.policy.after_commit(list(steps.values())):
                self._retire(victim)
                self.metrics.evictions.labels(reason="retention").inc()
            logger.info(
                "%s/step %d committed: %d files, %d bytes%s%s%s",
                namespace,
                step,
                len(rec.files),
                rec.bytes,
                f", a replica from {origin}" if origin else "",
                ", queued for the persistent tier" if rec.persist_pending else "",
                ", queued for replication" if rec.replication_pending else "",
            )
            info = rec.info()
        if rec.persist_pending and self.persister is not None:
            self.persister.enqueue(rec)
        if rec.replication_pending and self.replicator is not None:
            self.replicator.enqueue(rec)
        return info

    def _wants_persist(self, namespace: str, step: int, asked: bool | None) -> bool:
        if self.persister is None:
            if asked:
                logger.warning(
                    "%s/step %d asked to be persisted, but no persistent tier is configured "
                    "(TIERCKPT_PERSIST_URL); it stays in memory only",
                    namespace,
                    step,
                )
            return False
        if asked is not None:
            if asked:
                self._commits_since_persist[namespace] = 0
            return asked
        n = self._commits_since_persist.get(namespace, self.persist_every - 1) + 1
        if n >= self.persist_every:
            self._commits_since_persist[namespace] = 0
            return True
        self._commits_since_persist[namespace] = n
        return False

    def record(self, namespace: str, step: int) -> StepRecord:
        with self._lock:
            return self._get_committed(namespace, step)

    def records(self, namespace: str) -> list[StepRecord]:
        """The committed steps of ``namespace`` in memory, oldest first."""
        validate_namespace(namespace)
        with self._lock:
            return [r for _, r in sorted(self._committed.get(namespace, {}).items())]

    def candidates(self, namespace: str) -> list[StepCandidate]:
        """Steps ``latest`` may pick, newest first: committed in memory, held by a peer, or
        durable. Unreachable peers are skipped (with a warning), never waited for long."""
        validate_namespace(namespace)
        on_peers: dict[int, list[str]] = {}
        if self.replicator is not None:
            on_peers = self.replicator.peer_steps(namespace)
        with self._lock:
            in_memory = {s: r for s, r in self._committed.get(namespace, {}).items()}
        durable: set[int] = set()
        tier_error: PersistentTierError | None = None
        if self.persister is not None:
            try:
                durable = set(self.persister.durable_steps(namespace))
            except PersistentTierError as e:
                # A broken persistent tier must not take the memory tier down with it.
                logger.warning("%s: listing the persistent tier failed: %s", namespace, e)
                tier_error = e
        durable |= {s for s, r in in_memory.items() if r.state == StepState.DURABLE}
        steps = sorted(set(in_memory) | durable | set(on_peers), reverse=True)
        if not steps:
            if tier_error is not None:
                raise tier_error
            where = " or the persistent tier" if self.persister else ""
            where += ", nor do its peers hold one" if self.replicator else ""
            raise NamespaceNotFoundError(
                f"namespace {namespace} has no committed step in memory{where}"
            )
        return [
            StepCandidate(
                step=s, in_memory=s in in_memory, durable=s in durable, peers=on_peers.get(s, [])
            )
            for s in steps
        ]

    def persist_now(self, namespace: str, step: int) -> StepInfo:
        """Queue a committed step for upload now, whatever the policy said at commit."""
        if self.persister is None:
            raise PersistentTierError(
                "no persistent tier is configured on this daemon (TIERCKPT_PERSIST_URL)"
            )
        with self._lock:
            rec = self._get_committed(namespace, step)
            queue = rec.state == StepState.COMMITTED and not rec.persist_pending
            if queue:
                rec.persist_pending = True
                update_manifest(rec)
            info = rec.info()
        if queue:
            self.persister.enqueue(rec)
        return info

    def hydrate(self, namespace: str, step: int) -> StepInfo:
        """Make a step available in memory: already here, else a verified copy from a peer that
        holds a replica, else from the persistent tier. Concurrent calls for one step (every rank
        of the node asks) wait for the first."""
        validate_namespace(namespace)
        validate_step(step)
        with self._lock:
            lock = self._hydrate_locks.setdefault((namespace, step), threading.Lock())
        with lock:
            try:
                return self.get_step(namespace, step)
            except NotFoundError as e:
                missing: NotFoundError = e
            if self.replicator is not None:
                try:
                    return self.replicator.hydrate(namespace, step)
                except NotFoundError as e:
                    missing = e
                except CheckpointFormatError as e:  # every replica failed verification
                    if self.persister is None:
                        raise
                    logger.warning(
                        "%s/step %d: no good replica on the peers (%s); trying the persistent tier",
                        namespace,
                        step,
                        e,
                    )
            if self.persister is None:
                raise missing
            return self.persister.hydrate(namespace, step)

    # -- persistence hooks (called by the Persister) ---------------------------------------
    def is_current(self, rec: StepRecord) -> bool:
        with self._lock:
            return self._committed.get(rec.namespace, {}).get(rec.step) is rec

    def mark_durable(self, rec: StepRecord, checksums: dict[str, str]) -> None:
        with self._lock:
            for f in rec.files.values():
                f.checksum = checksums.get(f.name, f.checksum)
            rec.persist_pending = False
            rec.state = StepState.DURABLE
            if rec.manifest_path().exists():
                update_manifest(rec)
            self._drop_if_retired(rec)

    # -- replication hooks (called by the Replicator) --------------------------------------
    def mark_replicated(self, rec: StepRecord, peer: str, checksums: dict[str, str]) -> None:
        """``peer`` now holds a verified copy of ``rec`` (whose files have ``checksums``)."""
        with self._lock:
            rec.learn_checksums(checksums)
            if peer not in rec.replicated_to:
                rec.replicated_to.append(peer)
            if rec.manifest_path().exists():
                update_manifest(rec)

    def set_checksums(self, rec: StepRecord, checksums: dict[str, str]) -> None:
        with self._lock:
            rec.learn_checksums(checksums)
            if rec.manifest_path().exists():
                update_manifest(rec)

    def end_replication(self, rec: StepRecord) -> None:
        """Replication of ``rec`` is done, or moot (superseded, deleted, retired): stop holding
        it in memory for it."""
        with self._lock:
            rec.replication_pending = False
            if rec.manifest_path().exists():
                update_manifest(rec)
            self._drop_if_retired(rec)

    def pending_replications(self) -> list[StepRecord]:
        with self._lock:
            recs = [r for steps in self._committed.values() for r in steps.values()]
            return sorted(
                (r for r in recs if r.replication_pending), key=lambda r: r.committed_at or 0
            )

    def cancel_persist(self, rec: StepRecord) -> None:
        """The step was superseded or deleted before its upload: stop holding it for one."""
        with self._lock:
            rec.persist_pending = False
            if rec.manifest_path().exists():
                update_manifest(rec)
            self._drop_if_retired(rec)

    def _drop_if_retired(self, rec: StepRecord) -> None:
        if rec.evict_pending and safe_to_evict(rec):
            self._drop(rec)

    def pending_uploads(self) -> list[StepRecord]:
        with self._lock:
            recs = [r for steps in self._committed.values() for r in steps.values()]
            return sorted((r for r in recs if r.persist_pending), key=lambda r: r.committed_at or 0)

    # -- eviction ---------------------------------------------------------------------------
    def _retire(self, rec: StepRecord) -> None:
        """Take ``rec`` out of the index; its files go to the pool once no reader holds it."""
        steps = self._committed.get(rec.namespace, {})
        if steps.get(rec.step) is rec:
            del steps[rec.step]
        if safe_to_evict(rec):
            self._drop(rec)
        else:
            rec.evict_pending = True
            self._evicting.append(rec)

    def _evict(self, rec: StepRecord, *, to_pool: bool) -> None:
        steps = self._committed.get(rec.namespace, {})
        if steps.get(rec.step) is rec:
            del steps[rec.step]
        self._drop(rec, to_pool=to_pool)

    def _drop(self, rec: StepRecord, *, to_pool: bool = True) -> None:
        manifest = rec.manifest_path()
        manifest.unlink(missing_ok=True)  # first: a crash from here on leaves an uncommitted dir
        for f in rec.files.values():
            if to_pool:
                self.arena.adopt_into_pool(rec.dir / f.name)
            else:
                self.arena.delete(rec.dir / f.name)
        self._reclaim_dir(rec.dir)
        ns_dir = rec.dir.parent
        if ns_dir.exists() and not any(ns_dir.iterdir()):
            ns_dir.rmdir()
        if rec in self._evicting:
            self._evicting.remove(rec)

    def delete_step(self, namespace: str, step: int) -> None:
        with self._lock:
            rec = self._get_committed(namespace, step)
            self._retire(rec)
            self.metrics.evictions.labels(reason="deleted").inc()

    # -- reads ------------------------------------------------------------------------------
    def _get_committed(self, namespace: str, step: int) -> StepRecord:
        validate_namespace(namespace)
        validate_step(step)
        steps = self._committed.get(namespace)
        if not steps:
            raise NamespaceNotFoundError(f"namespace {namespace} has no committed steps in memory")
        rec = steps.get(step)
        if rec is None:
            raise StepNotFoundError(
                f"{namespace}/step {step} is not committed in memory (committed: "
                f"{sorted(steps)[-8:]})"
            )
        return rec

    def list_namespaces(self) -> list[NamespaceInfo]:
        with self._lock:
            names = set(self._committed) | {k[0] for k in self._writing}
            return [self._ns_info(ns) for ns in sorted(names)]

    def _ns_info(self, ns: str) -> NamespaceInfo:
        committed = self._committed.get(ns, {})
        writing = [r for k, r in self._writing.items() if k[0] == ns]
        return NamespaceInfo(
            namespace=ns,
            steps=len(committed) + len(writing),
            committed_steps=len(committed),
            bytes=sum(r.bytes for r in committed.values()) + sum(r.bytes for r in writing),
            latest_committed=max(committed) if committed else None,
        )

    def list_steps(self, namespace: str) -> list[StepInfo]:
        validate_namespace(namespace)
        with self._lock:
            recs = list(self._committed.get(namespace, {}).values())
            recs += [r for k, r in self._writing.items() if k[0] == namespace]
            if not recs:
                raise NamespaceNotFoundError(f"namespace {namespace} is unknown to this daemon")
            return [r.info() for r in sorted(recs, key=lambda r: (r.step, r.state.value))]

    def get_step(self, namespace: str, step: int) -> StepInfo:
        with self._lock:
            return self._get_committed(namespace, step).info()

    def latest(self, namespace: str) -> StepInfo:
        validate_namespace(namespace)
        with self._lock:
            steps = self._committed.get(namespace)
            if not steps:
                raise NamespaceNotFoundError(
                    f"namespace {namespace} has no committed step in memory"
                )
            return steps[max(steps)].info()

    def metadata(self, namespace: str, step: int) -> dict[str, Any]:
        with self._lock:
            path = self._get_committed(namespace, step).manifest_path()
        return read_manifest(path).metadata

    def pin(self, namespace: str, step: int, attempt: str | None = None) -> PinResponse:
        with self._lock:
            rec = self._get_committed(namespace, step)
            if attempt is not None and rec.attempt != attempt:
                raise StepStateError(
                    f"{namespace}/step {step}: attempt {attempt} was superseded by {rec.attempt}"
                )
            pin_id = uuid.uuid4().hex
            rec.pins[pin_id] = time.monotonic() + PIN_TTL_S
            return PinResponse(
                pin_id=pin_id,
                step=rec.info(),
                paths={name: str(rec.dir / name) for name in rec.files},
                expires_in_s=PIN_TTL_S,
            )

    def unpin(self, namespace: str, step: int, pin_id: str) -> None:
        with self._lock:
            for rec in self._records_of(namespace, step):
                if rec.pins.pop(pin_id, None) is not None:
                    self._drop_if_retired(rec)
                    return
            raise LeaseNotFoundError(f"{namespace}/step {step}: no pin {pin_id}")

    def _records_of(self, namespace: str, step: int) -> Iterator[StepRecord]:
        rec = self._committed.get(namespace, {}).get(step)
        if rec is not None:
            yield rec
        yield from (r for r in self._evicting if r.namespace == namespace and r.step == step)

    # -- housekeeping -----------------------------------------------------------------------
    def sweep(self) -> None:
        """Expire leases, stalled saves and pins; trim long-idle pool files."""
        now = time.monotonic()
        with self._lock:
            for lease in [le for le in self._leases.values() if le.expires < now]:
                logger.warning(
                    "lease %s of %s rank %d expired unsealed; reclaiming %d bytes",
                    lease.lease_id,
                    lease.namespace,
                    lease.rank,
                    lease.size,
                )
                del self._leases[lease.lease_id]
                self.arena.adopt_into_pool(lease.path)
            for key, rec in list(self._writing.items()):
                if now - rec.last_activity > self.lease_ttl_s:
                    logger.warning(
                        "%s/step %d: save attempt %s stalled for %.0fs; reclaiming its files",
                        rec.namespace,
                        rec.step,
                        rec.attempt,
                        now - rec.last_activity,
                    )
                    del self._writing[key]
                    self._reclaim_dir(rec.dir)
            for rec in [r for s in self._committed.values() for r in s.values()] + self._evicting:
                for pin_id in [p for p, exp in rec.pins.items() if exp < now]:
                    del rec.pins[pin_id]
                self._drop_if_retired(rec)
            self.arena.trim_pool(0, idle_s=POOL_IDLE_S)

    def snapshot(self) -> Snapshot:
        with self._lock:
            by_state: dict[str, int] = {st.value: 0 for st in StepState}
            steps: dict[str, int] = {st.value: 0 for st in StepState}
            for rec in [r for s in self._committed.values() for r in s.values()]:
                by_state[rec.state.value] += rec.bytes
                steps[rec.state.value] += 1
            for rec in self._writing.values():
                by_state[StepState.WRITING.value] += rec.bytes
                steps[StepState.WRITING.value] += 1
            by_state["retiring"] = sum(r.bytes for r in self._evicting)
            by_state["pool"] = self.arena.pool_bytes
            by_state["leased"] = sum(le.size for le in self._leases.values())
            persistent = self.persister.status() if self.persister is not None else None
            replication = self.replicator.status() if self.replicator is not None else None
            return Snapshot(
                capacity_bytes=self.arena.capacity_bytes,
                bytes_by_state=by_state,
                steps_by_state=steps,
                upload_queue=persistent.queued_steps if persistent else 0,
                persistent_healthy=persistent.healthy if persistent else None,
                replication_queue=replication.queued_steps if replication else 0,
            )

    def status(self, shm_dir: str) -> StatusResponse:
        with self._lock:
            return StatusResponse(
                version=__version__,
                api_version=API_VERSION,
                shm_dir=shm_dir,
                capacity_bytes=self.arena.capacity_bytes,
                used_bytes=self.arena.used_bytes,
                pool_bytes=self.arena.pool_bytes,
                pool_files=self.arena.pool_files,
                leased_bytes=sum(le.size for le in self._leases.values()),
                keep_last=self.keep_last,
                namespaces=[
                    self._ns_info(ns)
                    for ns in sorted(set(self._committed) | {k[0] for k in self._writing})
                ],
                persistent=self.persister.status() if self.persister is not None else None,
                replication=self.replicator.status() if self.replicator is not None else None,
            )
