"""Replication to peers: push committed steps to the next k daemons on the ring (the
:class:`~tierckpt_daemon.peers.membership.Ring`), and answer a peer's pull of its step (copied by
the :class:`~tierckpt_daemon.peers.copier.Copier`).

Pushes run in the daemon's background, never in the trainer. One worker takes committed steps in
commit order; each step's files stream in parallel (``TIERCKPT_REPLICATION_CONCURRENCY``) into a
pending replica on the peer, hashed on the way, and the peer checks every byte against the
checksums in the final commit; the replica's daemon reads them no faster than its
``TIERCKPT_REPLICATION_MAX_RATE`` (:mod:`tierckpt_daemon.peers.pacing`). A successor that cannot
be reached is skipped for the next one on the ring, so k replicas still exist when k peers are up; a step short of replicas is retried with
backoff while newer steps go ahead. A step is held in memory until its replication is done or moot
(superseded, deleted or retired by retention). Replication starts at the commit, in the
background: until it is done, the step is on this node only, and losing the node then loses it
(a save made with ``wait="replicated"`` returns only once every share has its replicas:
:mod:`tierckpt_daemon.peers.replica_wait`).

Restores (:mod:`tierckpt_daemon.peers.fetch`) ask the ring successors first (where this node's
replicas went) and verify every file before the step is committed locally; a corrupt replica is
skipped for the next source.
"""

from __future__ import annotations

import logging
import time

from tierckpt_core.errors import (
    ForbiddenError,
    NamespaceOwnerError,
    NotAMemberError,
    NotFoundError,
    PeerUnavailableError,
    ProtocolError,
    TierCkptError,
)
from tierckpt_core.manifest import FileRecord
from tierckpt_core.protocol import (
    ReplicationStatus,
    StepInfo,
)
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.copier import Copier, held_files
from tierckpt_daemon.peers.membership import Ring
from tierckpt_daemon.tier.background import QueueWorker
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

RETRY_BASE_S = 1.0
RETRY_MAX_S = 60.0


class Replicator(QueueWorker[StepRecord]):
    """Pushes committed steps to ring successors (a commit listener of the service) and answers
    peers' pulls (copied by the :class:`~tierckpt_daemon.peers.copier.Copier`)."""

    def __init__(
        self,
        service: TierService,
        ring: Ring,
        client: PeerClient,
        copier: Copier,
        *,
        nice: int = 0,
    ) -> None:
        super().__init__(
            "tierckpt-replicator", nice=nice, retry_base_s=RETRY_BASE_S, retry_max_s=RETRY_MAX_S
        )
        self.service = service
        self.ring = ring
        self.client = client
        self.copier = copier
        self.node = ring.node
        self.replicas = ring.replicas
        self._last_error: str | None = None
        self._last_skip: str | None = None  # the reason of the last skip, until a push succeeds
        self._refusing: set[str] = set()  # peers that refused a push, until one succeeds

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        for rec in self.service.pending_replications():
            logger.info("%s/step %d: resuming its replication", rec.namespace, rec.step)
            self.enqueue(rec)
        super().start()

    def committed(self, rec: StepRecord) -> None:
        """Commit listener: queue the step if it is to be replicated."""
        if rec.replication_pending:
            self.enqueue(rec)

    def persist_requested(self, rec: StepRecord) -> None:
        pass

    def retired(self, rec: StepRecord) -> None:
        if rec.replication_pending:
            self.hurry(rec)  # skipped (said, counted), then its files leave memory

    def status(self) -> ReplicationStatus:
        m = self.service.metrics
        members, unreachable = self.ring.seen()
        with self._cv:
            last_error = self._last_error
        return ReplicationStatus(
            node=self.node,
            peers=members,
            replicas=self.replicas,
            queued_steps=self.queued(),
            replicated_steps=m.total(m.replicated_steps),
            replicated_bytes=m.total(m.replicated_bytes),
            received_steps=m.total(m.replicas_received),
            failed_pushes=m.total(m.replication_failures),
            skipped_steps=m.total(m.replication_skips),
            unreachable=unreachable,
            last_error=last_error,
        )

    # -- pushes ---------------------------------------------------------------------------
    def _process(self, rec: StepRecord) -> bool:
        try:
            return self._replicate(rec)
        except Exception as e:  # say so in the status too, then let the worker retry the step
            self._record_failure(rec, f"{rec.namespace}/step {rec.step}: {e!r}")
            raise

    def _skip(self, rec: StepRecord, reason: str) -> None:
        """``rec`` will never be replicated: say why (once per run of skips), count it."""
        why = {
            "superseded": "a newer save of the same step replaced it (that one is replicated)",
            "retired": "it left memory first (retention, or it was deleted) while its pushes were "
            "still failing",
            "no_peers": f"no other daemon is a member of the ring ({self.ring.membership.describe()})",
            "refused": "every peer it could go to refuses it (the namespace belongs to another "
            "owner there, or the peer committed that step itself)",
        }[reason]
        with self._cv:
            first = self._last_skip != reason
            self._last_skip = reason
        log = logger.warning if first else logger.debug
        log(
            "%s/step %d is not replicated: %s",
            rec.namespace,
            rec.step,
            why,
            extra=step_fields(rec.namespace, rec.step, rec.attempt),
        )
        self.service.metrics.replication_skips.labels(reason=reason).inc()
        self.service.end_replication(rec)

    def _died(self, error: BaseException) -> None:
        with self._cv:
            self._last_error = (
                f"the replication thread ({self.name}) died of {type(error).__name__}: {error}; "
                "no step is pushed to peers until the daemon restarts (see the log)"
            )

    def _record_failure(self, rec: StepRecord, message: str) -> None:
        self.service.metrics.replication_failures.inc()
        with self._cv:
            self._last_error = message

    def _replicate(self, rec: StepRecord) -> bool:
        """Push ``rec`` until ``replicas`` successors hold it; False: retry later."""
        ns, step = rec.namespace, rec.step
        if not self.service.is_current(rec):  # superseded, deleted or retired meanwhile
            self._skip(rec, "superseded" if self.service.has_step(ns, step) else "retired")
            return True
        try:
            targets = self.ring.successors()
        except PeerUnavailableError as e:
            self._record_failure(rec, f"{ns}/step {step}: {e}")
            logger.warning("%s", e)
            return False
        if not targets:
            self._skip(rec, "no_peers")
            return True
        want = min(self.replicas, len(targets))
        have = [p for p in rec.replicated_to if p in targets]
        errors: list[str] = []
        refused: list[str] = []
        for peer in targets:
            if len(have) >= want:
                break
            if peer in have:
                continue
            try:
                self._push(rec, peer)
            except NamespaceOwnerError as e:  # for good: retrying would not change the answer
                refused.append(peer)
                errors.append(f"{peer}: {e}")
                continue
            except ProtocolError as e:
                if isinstance(e, NotAMemberError):  # (raised here: the ring changed meanwhile)
                    self.ring.peer_failed(peer, e)
                else:
                    self._refused_by(peer, e)
                errors.append(f"{peer}: {e}")
                continue
            except (TierCkptError, OSError) as e:
                self.ring.peer_failed(peer, e)
                errors.append(f"{peer}: {e}")
                continue
            self.ring.peer_ok(peer)
            with self._cv:
                self._refusing.discard(peer)
            have.append(peer)
        if len(have) >= want:
            self.service.end_replication(rec)
            with self._cv:
                self._last_skip = None
            if errors:
                logger.info("%s/step %d replicated to %s instead", ns, step, ", ".join(have))
            with self._cv:
                self._last_error = None
            return True
        if refused and all(p in have or p in refused for p in targets):
            self._record_failure(rec, f"{ns}/step {step}: {'; '.join(errors)}")
            self._skip(rec, "refused")
            return True
        self._record_failure(
            rec,
            f"{ns}/step {step}: replicated to {len(have)} of {want} peers ({'; '.join(errors)}); "
            "retrying (the step stays in memory)",
        )
        return False

    def _refused_by(self, peer: str, e: ProtocolError) -> None:
        """``peer`` answered, and refused what this node sent it (the records of a step): not
        an outage (the peer stays a member in good standing), most often a daemon of another
        tierckpt version. Said once until a push to it succeeds; the step is tried again with
        the backoff, so it goes once that daemon is upgraded."""
        with self._cv:
            first = peer not in self._refusing
            self._refusing.add(peer)
        if first:
            logger.warning(
                "peer %s refuses this node's replicas (%s); it answers, so it may run a tierckpt "
                "version that does not know what this one writes: run one version on every "
                'daemon (docs/operations.md, "Upgrades and restarts"); retrying with backoff',
                peer,
                e,
            )

    def share(self, rec: StepRecord) -> list[FileRecord]:
        """What this node replicates of ``rec``: a step of its own, whole; of a step spanning
        nodes, the files its own ranks wrote (each node replicates its own share)."""
        files = rec.sorted_files()
        if rec.spans_nodes:
            files = [f for f in files if f.node == self.node]
        return files

    def _push(self, rec: StepRecord, peer: str) -> None:
        ns, step = rec.namespace, rec.step
        files = self.share(rec)
        if files and all(f.checksum for f in files):
            # Already there (e.g. the peer this step was restored from)? Then no bytes move.
            try:
                theirs = self.client.manifest(peer, ns, step)
            except NotFoundError:
                pass
            else:
                held = held_files(theirs)
                if all(
                    f.name in held and (theirs.file(f.name) or f).checksum == f.checksum
                    for f in files
                ) and (rec.spans_nodes or len(theirs.files) == len(files)):
                    self.service.mark_replicated(rec, peer, {})
                    return
        t0 = time.monotonic()
        nbytes = sum(f.length for f in files)
        # The peer pulls: it fetches our manifest (with the files' checksums, computed now if no
        # upload did yet) and every file over the same fast path a restore uses, verifies them,
        # and commits the replica before it answers.
        info = self.client.pull(peer, ns, step, self.node, nbytes)
        # A share of a step spanning nodes may join the peer's own part of it (no origin there).
        if info.step != step or (info.origin != self.node and not rec.spans_nodes):
            raise ProtocolError(f"peer {peer} answered the pull of {ns}/step {step} with {info}")
        self.service.mark_replicated(rec, peer, {})
        self.service.metrics.replicated_bytes.inc(nbytes)
        self.service.metrics.replicated_steps.inc()
        dt = time.monotonic() - t0
        logger.info(
            "%s/step %d replicated to %s: %d files, %d bytes in %.2fs (%.0f MB/s)",
            ns,
            step,
            peer,
            len(files),
            nbytes,
            dt,
            nbytes / max(dt, 1e-9) / 1e6,
            extra=step_fields(ns, step, rec.attempt),
        )

    def pull_from(self, origin: str, namespace: str, step: int) -> StepInfo:
        """A peer's replication request: copy its committed ``namespace/step`` here, verified,
        as a replica whose origin is ``origin``. Only members of the ring are pulled from (the
        token goes with every request, so it must not go to an address a caller names)."""
        members = self.ring.members()
        if origin not in members or origin == self.node:
            raise ForbiddenError(
                f"{origin} is not a peer of this daemon ({self.node}); its members are "
                f"{', '.join(sorted(members)) or 'none'}"
            )
        manifest = self.client.manifest(origin, namespace, step)
        if (manifest.namespace, manifest.step) != (namespace, step):
            raise ProtocolError(f"peer {origin} answered for {manifest.namespace}/{manifest.step}")
        rec = self.copier.copy_from(origin, manifest, replica=True)
        got = manifest.share(origin) if manifest.coordinator is not None else manifest.files
        self.service.metrics.replica_received_bytes.inc(sum(f.length for f in got))
        self.service.metrics.replicas_received.inc()
        return rec.info()
