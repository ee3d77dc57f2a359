"""What the uploader and the replicator ask of the memory tier and report back to it.

:class:`~tierckpt_daemon.tier.service.TierService` inherits these: they are the background workers'
half of its interface (which steps wait for an upload or a replica, and what became of them),
kept apart from the lease -> seal -> commit -> pin -> evict state machine the trainers drive. Each
method takes the service's lock; a report about a step that was meanwhile retired lets retention
drop it (``drop_if_retired``).
"""

from __future__ import annotations

import logging
import threading
import time

from tierckpt_core.protocol import StepState
from tierckpt_daemon.metrics import Metrics
from tierckpt_daemon.tier.freshness import Freshness
from tierckpt_daemon.tier.index import StepIndex
from tierckpt_daemon.tier.records import StepRecord, update_manifest

logger = logging.getLogger(__name__)


class WorkerReports:
    lock: threading.RLock
    index: StepIndex
    freshness: Freshness
    metrics: Metrics

    def has_step(self, namespace: str, step: int) -> bool:
        """Whether ``namespace``/``step`` is committed in memory here."""
        with self.lock:
            return step in self.index.committed.get(namespace, {})

    def is_current(self, rec: StepRecord) -> bool:
        with self.lock:
            return self.index.committed.get(rec.namespace, {}).get(rec.step) is rec

    def mark_durable(
        self, rec: StepRecord, checksums: dict[str, str], *, uploaded: bool = False
    ) -> None:
        """``rec`` is complete in the persistent tier (``uploaded`` now by this node, or read)."""
        with self.lock:
            for f in rec.files.values():
                f.checksum = checksums.get(f.name, f.checksum)
            rec.persist_pending = False
            rec.state = StepState.DURABLE
            if uploaded:
                rec.durable_at = time.time()
                self.freshness.durable(rec.namespace, rec.durable_at)
            self._save_state(rec)

    def upload_ended(self, rec: StepRecord) -> None:
        """An upload attempt of ``rec`` ended (durable, failed, skipped): retention kept it for
        it (eviction.KeepLatestN), so it runs again now, not only at the next commit (the last
        steps of a job would stay in memory beyond TIERCKPT_KEEP_LAST for good)."""
        with self.lock:
            retired = self.index.retention(rec.namespace, rec.owner)
            for victim in retired:
                self.index.retire(victim)
                self.metrics.evictions.labels(reason="retention").inc()
        if retired:
            logger.info(
                "%s: step(s) %s leave memory (TIERCKPT_KEEP_LAST), kept until the upload of step "
                "%d ended",
                rec.namespace,
                ", ".join(str(r.step) for r in retired),
                rec.step,
            )

    def mark_replicated(self, rec: StepRecord, peer: str, checksums: dict[str, str]) -> None:
        """``peer`` now holds a verified copy of ``rec`` (whose files have ``checksums``)."""
        with self.lock:
            rec.learn_checksums(checksums)
            if peer not in rec.replicated_to:
                rec.replicated_to.append(peer)
            self._save_state(rec, drop=False)

    def set_checksums(self, rec: StepRecord, checksums: dict[str, str]) -> None:
        with self.lock:
            rec.learn_checksums(checksums)
            self._save_state(rec, drop=False)

    def end_replication(self, rec: StepRecord) -> None:
        """Replication of ``rec`` is done, or moot (superseded, deleted, retired): stop holding
        it in memory for it."""
        with self.lock:
            rec.replication_pending = False
            self._save_state(rec)

    def share_persisted(self, rec: StepRecord) -> None:
        """This node's share of a step spanning nodes is in the persistent tier (the decider
        makes the step durable there once every share is)."""
        with self.lock:
            rec.persist_pending = False
            rec.share_uploaded = True  # still due here until the marker is read: share_durable
            self._save_state(rec)

    def cancel_persist(self, rec: StepRecord) -> None:
        """The step was superseded or deleted before its upload: stop holding it for one."""
        with self.lock:
            rec.persist_pending = False
            self._save_state(rec)

    def _save_state(self, rec: StepRecord, *, drop: bool = True) -> None:
        if rec.manifest_path().exists():
            update_manifest(rec)
        if drop:
            self.index.drop_if_retired(rec)

    def pending_uploads(self) -> list[StepRecord]:
        with self.lock:
            recs = self.index.all_committed()
            return sorted((r for r in recs if r.persist_pending), key=lambda r: r.committed_at or 0)

    def pending_replications(self) -> list[StepRecord]:
        with self.lock:
            recs = self.index.all_committed()
            return sorted(
                (r for r in recs if r.replication_pending), key=lambda r: r.committed_at or 0
            )
