"""The memory tier's state machine: lease -> seal -> commit -> pin -> evict.

One :class:`TierService` per daemon. Every public method is safe to call from several threads: the
state is guarded by one lock, and the only slow operation (allocating fresh tmpfs pages for a new
file) runs outside it against a reservation (see :mod:`tierckpt_daemon.tier.leases`).

Write path of one save attempt (one per ``dcp.save``/``async_save`` call)::

    lease(rank, size)          -> a pre-faulted file under leases/ (recycled from the pool if possible)
    seal(step, attempt, rank)  -> the rank's leased files move into the attempt's step directory
    commit(step, attempt)      -> every listed file is sealed: write MANIFEST.json, state COMMITTED,
                                  older attempts of the step and steps beyond retention are retired,
                                  and the step listeners (uploader, replicator) hear of it

Evicted files go to the pool; the next lease of the same size takes them back (see arena.py). The
step tables and their rebuild live in :mod:`tierckpt_daemon.tier.index`; where a step not in
memory comes from, in :mod:`tierckpt_daemon.tier.restore`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Protocol

from tierckpt_core.errors import (
    NamespaceOwnerError,
    StepNotFoundError,
    StepStateError,
)
from tierckpt_core.integrity import checksum_file_blocks
from tierckpt_core.manifest import StepManifest
from tierckpt_core.protocol import (
    CommitRequest,
    LeaseAfter,
    LeaseResponse,
    StepInfo,
    StepState,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.metrics import Metrics
from tierckpt_daemon.tier.arena import Arena
from tierckpt_daemon.tier.attempts import Attempts
from tierckpt_daemon.tier.copies import Copies
from tierckpt_daemon.tier.eviction import EvictionPolicy, KeepLatestN
from tierckpt_daemon.tier.freshness import Freshness
from tierckpt_daemon.tier.housekeeping import Housekeeping
from tierckpt_daemon.tier.index import StepIndex
from tierckpt_daemon.tier.leases import Leases
from tierckpt_daemon.tier.ownership import Ownership
from tierckpt_daemon.tier.queries import PIN_TTL_S, Queries
from tierckpt_daemon.tier.records import (
    StepRecord,
    committed_here,
    update_manifest,
    write_manifest,
)
from tierckpt_daemon.tier.sealing import Sealing
from tierckpt_daemon.tier.worker_reports import WorkerReports
from tierckpt_daemon.tier.writers import any_alive

logger = logging.getLogger(__name__)

# How long a step hydrated for a reader stays in memory against retention if no reader pins and
# unpins it (a reader that died between hydrating and reading).
HOLD_S = PIN_TTL_S


class StepListener(Protocol):
    """Hears of steps with work to do outside the memory tier (the uploader, the replicator)."""

    def committed(self, rec: StepRecord) -> None:
        """``rec`` was just committed (its ``persist_pending``/``replication_pending`` say what
        it still needs)."""
        ...

    def persist_requested(self, rec: StepRecord) -> None:
        """``rec`` is to be persisted now, whatever the policy said at commit."""
        ...

    def retired(self, rec: StepRecord) -> None:
        """``rec`` left the committed steps while it still waits for this worker (its upload or
        replica): the worker's next look at it lets it go, so that look is due now, not after
        a retry's backoff (up to minutes, its files held in memory meanwhile)."""
        ...


class TierService(Queries, WorkerReports, Ownership, Attempts, Sealing, Housekeeping, Copies):
    def __init__(
        self,
        arena: Arena,
        *,
        keep_last: int = 2,
        lease_ttl_s: float = 900.0,
        policy: EvictionPolicy | None = None,
        spares: bool = True,
        persistent: bool = False,
        persist_every: int = 1,
        replicas: int = 0,
        node: str | None = None,
    ) -> None:
        self.arena = arena
        self.keep_last = keep_last
        self.lease_ttl_s = lease_ttl_s
        self.lock = threading.RLock()
        self.metrics = Metrics()
        self.freshness = Freshness()  # for the "seconds since the last committed/durable step"
        self.index = StepIndex(arena, policy or KeepLatestN(keep_last))
        self.leases = Leases(
            arena,
            self.index,
            self.metrics,
            self.lock,
            keep_last=keep_last,
            ttl_s=lease_ttl_s,
            spares=spares,
        )
        # With a persistent tier: upload every ``persist_every``-th commit (TIERCKPT_PERSIST_*).
        self.persistent = persistent
        self.persist_every = persist_every
        self.replicas = replicas  # with peers: replicas of each step (TIERCKPT_REPLICAS)
        self.node = node  # this daemon's name among its peers (TIERCKPT_NODE_NAME)
        self._preparing: set[tuple[str, int, str]] = set()  # attempts checksummed for a prepare
        self._commits_since_persist: dict[str, int] = {}
        self._listeners: list[StepListener] = []

    @contextlib.contextmanager
    def lock_if_free(self) -> Iterator[bool]:
        """Whether the service's lock was free now (then held until the block ends): a caller on
        an event loop runs a quick call there if so, else in a thread, and never waits."""
        free = self.lock.acquire(blocking=False)
        try:
            yield free
        finally:
            if free:
                self.lock.release()

    def add_listener(self, listener: StepListener) -> None:
        self._listeners.append(listener)

    def rebuild(self) -> None:
        """Rebuild the index from the tier directory after a (re)start."""
        with self.lock:
            self.index.rebuild()
            self.freshness.seed(self.index.all_committed())
            damaged = self.index.damaged_records  # for TierckptVerificationFailures
            self.metrics.verification_failures.labels(tier="memory").inc(damaged)

    # -- leases -----------------------------------------------------------------------------
    def lease(
        self,
        namespace: str,
        rank: int,
        size: int,
        *,
        prefault: bool = True,
        after: LeaseAfter | None = None,
        owner: str | None = None,
    ) -> LeaseResponse:
        """A file of ``size`` bytes for ``rank``. ``prefault=False`` (a download will write every
        byte anyway) neither zero-fills new pages nor prepares a spare. ``after``: a pre-lease,
        granted when that save attempt commits (see :mod:`tierckpt_daemon.tier.leases`). ``owner``: the
        caller's identity; only it (or an administrator) may seal or release the lease."""
        if after is not None:
            return self.leases.ask_ahead(namespace, rank, size, after.step, after.attempt, owner)
        with self.metrics.lease_seconds.time():
            lease = self.leases.grant(namespace, rank, size, prefault=prefault, owner=owner)
        self.metrics.leases.labels(recycled=str(lease.recycled).lower()).inc()
        self.metrics.leased_bytes.inc(lease.size)
        return lease

    def release_lease(
        self, namespace: str, lease_id: str, owner: str | None = None, *, admin: bool = False
    ) -> None:
        self.leases.release(namespace, lease_id, owner, admin=admin)

    # -- commit -------------------------------------------------------------------------
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
        copy_of: StepManifest | None = None,
    ) -> StepInfo:
        """Commit a save attempt. ``replicate=False`` (a step hydrated from the persistent tier)
        and ``origin`` (a replica received from that peer) keep it from being pushed to peers;
        ``checksums`` are the files' checksums when already known; ``copy_of``: see
        :meth:`install`."""
        with self.metrics.commit_seconds.time():
            self.take_checksums(namespace, step, attempt, req.files, known=checksums or {})
            rec = self._commit(namespace, step, attempt, req, replicate, origin, checksums, copy_of)
        if copy_of is None:
            # A trainer's commit (copies are no progress of the job; one spanning nodes counts
            # in GlobalCommitter.decide). Before the uploader hears of it: its durable comes after.
            self.freshness.committed(namespace, rec.committed_at, due=rec.persist_pending)
        self.notify_committed(rec)
        return rec.info()

    def _commit(
        self,
        namespace: str,
        step: int,
        attempt: str,
        req: CommitRequest,
        replicate: bool,
        origin: str | None,
        checksums: dict[str, str] | None,
        copy_of: StepManifest | None,
    ) -> StepRecord:
        with self.lock:
            rec = self.writing_record(namespace, step, attempt)
            self.refuse_overwrite(namespace, step, req)
            self.keep_only(rec, req.files)
            rec.world_size = req.world_size
            rec.persist = req.persist
            persist = self.wants_persist(namespace, step, req.persist)
            return self.install(
                rec,
                req.metadata,
                persist=persist,
                replicate=replicate,
                origin=origin,
                checksums=checksums,
                copy_of=copy_of,
            )

    def abort(self, namespace: str, step: int, attempt: str, *, abandoned: bool = False) -> None:
        """Give up a save attempt its writer saw fail: its sealed files go back to the pool now,
        not when the attempt stalls (``lease_ttl_s``). An attempt prepared for a commit across
        nodes is left to its coordinator's decision. ``abandoned``: an operator frees the
        attempt of a trainer that died mid-save; refused while a process that wrote it runs."""
        with self.lock:
            rec = self.writing_record(namespace, step, attempt)
            if rec.prepared_at is not None:
                raise StepStateError(
                    f"{namespace}/step {step}: attempt {attempt} is prepared for a commit across "
                    "nodes; its coordinator decides how it ends"
                )
            if abandoned and any_alive(rec.writers):
                raise StepStateError(
                    f"{namespace}/step {step}: attempt {attempt} is not abandoned: its writer "
                    f"(pid {', '.join(map(str, sorted(rec.writers)))}) still runs; stop it first, "
                    "or let it finish or fail the save"
                )
            logger.info(
                "%s/step %d: save attempt %s %s",
                namespace,
                step,
                attempt,
                "freed by an operator (abandoned)" if abandoned else "aborted by its writer",
                extra=step_fields(namespace, step, attempt),
            )
            self.index.abandon(rec)

    def take_checksums(
        self, namespace: str, step: int, attempt: str, names: list[str], known: dict[str, str]
    ) -> None:
        """Checksum the attempt's files that the writer sent none for (and that are not
        ``known``), before it is committed: every committed file has a checksum, taken once,
        which peers, the persistent tier and readers verify against."""
        with self.lock:
            rec = self.writing_record(namespace, step, attempt)
            todo = [
                (f.name, str(rec.dir / f.name), f.length)
                for f in rec.files.values()
                if f.checksum is None and f.name in names and f.name not in known
            ]
        sums = {name: checksum_file_blocks(path, length) for name, path, length in todo}
        with self.lock:
            for name, (whole, size, blocks) in sums.items():
                f = rec.files.get(name)
                if f is not None and f.checksum is None:
                    f.checksum, f.block_size, f.blocks = whole, size, blocks

    def refuse_overwrite(self, namespace: str, step: int, req: CommitRequest) -> None:
        """With ``req.overwrite`` False, a committed step of this number is not replaced."""
        with self.lock:
            if not req.overwrite and step in self.index.committed.get(namespace, {}):
                raise StepStateError(
                    f"{namespace}/step {step} is already committed and the save asked not to "
                    "replace it (overwrite=False); save under a new step, or pass overwrite=True"
                )

    def writing_record(self, namespace: str, step: int, attempt: str) -> StepRecord:
        """The record of a save attempt in progress (its ranks' sealed files)."""
        validate_namespace(namespace)
        validate_step(step)
        with self.lock:
            rec = self.index.writing.get((namespace, step, attempt))
            if rec is None:
                raise StepNotFoundError(
                    f"{namespace}/step {step}: no save in progress with attempt {attempt} (it "
                    "expired, was superseded, or the daemon restarted during the save)"
                )
            return rec

    def keep_only(self, rec: StepRecord, names: list[str]) -> None:
        """Check that every file in ``names`` is sealed into ``rec``; drop any other."""
        with self.lock:
            missing = sorted(set(names) - set(rec.files))
            if missing:
                raise StepStateError(
                    f"{rec.namespace}/step {rec.step}: cannot commit, {len(missing)} files were "
                    f"never sealed: {', '.join(missing[:8])}"
                )
            for name in sorted(set(rec.files) - set(names)):
                self.arena.adopt_into_pool(rec.dir / name, (rec.namespace, rec.files[name].rank))
                del rec.files[name]

    def install(
        self,
        rec: StepRecord,
        metadata: str,
        *,
        persist: bool,
        replicate: bool,
        origin: str | None = None,
        checksums: dict[str, str] | None = None,
        copy_of: StepManifest | None = None,
    ) -> StepRecord:
        """Commit the attempt ``rec`` (its files checked): write its commit record, make it its
        step's record, retire what it supersedes and what retention lets go. ``copy_of``: the
        record of the step ``rec`` copies (from a peer or the persistent tier), whose times it
        keeps (a copy is no new save: ``ls`` shows the step's age, not the copy's)."""
        namespace, step = rec.namespace, rec.step
        with self.lock:
            rec.origin = origin
            if not committed_here(rec):
                try:
                    self.refuse_copy(namespace, step, rec.attempt, rec.owner, besides=rec)
                except NamespaceOwnerError:
                    self.index.abandon(rec)
                    raise
            rec.persist_pending = persist
            rec.learn_checksums(checksums or {})
            rec.replication_pending = replicate and origin is None and self.replicas > 0
            rec.committed_at = time.time()
            if copy_of is not None and copy_of.committed_at:  # (a record from before: none)
                rec.committed_at = copy_of.committed_at
                rec.created_at = copy_of.created_at or copy_of.committed_at
            write_manifest(rec, metadata)
            rec.prepared_path().unlink(missing_ok=True)
            rec.state = StepState.COMMITTED
            old, retired = self.index.install(rec)
            self.leases.fulfil(namespace, step, rec.attempt)  # from the files retention freed
            if old is not None:
                logger.info(
                    "%s/step %d: new commit supersedes attempt %s",
                    namespace,
                    step,
                    old.attempt,
                    extra=step_fields(namespace, step, rec.attempt),
                )
                self.metrics.evictions.labels(reason="superseded").inc()
            for _ in retired:
                self.metrics.evictions.labels(reason="retention").inc()
            # Evictions are logged: the retention's here, with the commit that caused them.
            left = ", ".join(str(r.step) for r in retired)
            logger.info(
                "%s/step %d %s: %d files, %d bytes%s%s%s%s",
                namespace,
                step,
                _committed(copy_of),
                len(rec.files),
                rec.bytes,
                f", a replica from {origin}" if origin else "",
                ", queued for the persistent tier" if rec.persist_pending else "",
                ", queued for replication" if rec.replication_pending else "",
                f"; step(s) {left} of {namespace} leave memory (TIERCKPT_KEEP_LAST "
                f"{self.keep_last})"
                if retired
                else "",
                extra=step_fields(namespace, step, rec.attempt),
            )
            return rec

    def notify_committed(self, rec: StepRecord) -> None:
        self.metrics.commits.inc()
        for listener in self._listeners:
            listener.committed(rec)

    def wants_persist(self, namespace: str, step: int, asked: bool | None) -> bool:
        if not self.persistent:
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

    def persist_now(self, namespace: str, step: int, *, owner: str | None = None) -> StepInfo:
        """Queue a committed step for upload now, whatever the policy said at commit."""
        if not self.persistent:
            raise StepStateError(
                f"{namespace}/step {step} cannot be persisted: no persistent tier is configured "
                "on this daemon (set TIERCKPT_PERSIST_URL on the daemon)"
            )
        with self.lock:
            rec = self.record(namespace, step, owner=owner)
            # A participant's share already uploaded: the decider makes the step durable.
            queue = rec.state == StepState.COMMITTED and not (
                rec.persist_pending or rec.share_uploaded
            )
            if queue:
                rec.persist = rec.persist_pending = True
                update_manifest(rec)
            info = rec.info()
        if queue:
            self.persist_requested(rec)
        return info

    def persist_requested(self, rec: StepRecord) -> None:
        """Tell the uploader that ``rec`` (now ``persist_pending``) is to be persisted."""
        for listener in self._listeners:
            listener.persist_requested(rec)

    # -- reads ------------------------------------------------------------------------------
    def delete_step(self, namespace: str, step: int, *, owner: str | None = None) -> None:
        with self.lock:
            self.index.retire(self.record(namespace, step, owner=owner))
            self.metrics.evictions.labels(reason="deleted").inc()
            logger.info(
                "%s/step %d deleted from memory",
                namespace,
                step,
                extra=step_fields(namespace, step),
            )


def _committed(copy_of: StepManifest | None) -> str:
    """What the log says a commit was: a save, or a copy of one (and when that was saved)."""
    if copy_of is None:
        return "committed"
    if not copy_of.committed_at:
        return "copied into memory"
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(copy_of.committed_at))
    return f"copied into memory (committed {at})"
