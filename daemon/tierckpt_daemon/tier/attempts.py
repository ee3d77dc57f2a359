"""The service's half of a commit across nodes: a participant's save attempt prepared,
committed with the decider's global record, aborted, or asked about, each under the service's lock.

:class:`~tierckpt_daemon.tier.service.TierService` inherits these; the protocol around them (who
is asked, relays, the decider's own steps) is :mod:`tierckpt_daemon.peers.commit`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Protocol

from tierckpt_core.errors import ProtocolError, StepStateError
from tierckpt_core.integrity import checksum_file_blocks
from tierckpt_core.manifest import FileRecord, StepManifest, ring_of
from tierckpt_core.protocol import OutcomeResponse, StepState
from tierckpt_daemon.tier.records import (
    StepRecord,
    read_manifest,
    update_manifest,
    write_prepared,
)

if TYPE_CHECKING:
    from tierckpt_daemon.tier.freshness import Freshness
    from tierckpt_daemon.tier.index import StepIndex

logger = logging.getLogger(__name__)


class _Service(Protocol):
    """What these methods use of the service they are mixed into."""

    lock: threading.RLock
    index: StepIndex
    freshness: Freshness
    node: str | None
    _preparing: set[tuple[str, int, str]]  # attempts being checksummed for a prepare

    def writing_record(self, namespace: str, step: int, attempt: str) -> StepRecord: ...

    def keep_only(self, rec: StepRecord, names: list[str]) -> None: ...

    def install(
        self,
        rec: StepRecord,
        metadata: str,
        *,
        persist: bool,
        replicate: bool,
        origin: str | None = None,
        checksums: dict[str, str] | None = None,
    ) -> StepRecord: ...

    def notify_committed(self, rec: StepRecord) -> None: ...

    def persist_requested(self, rec: StepRecord) -> None: ...

    def _take_share(self, m: StepManifest, *, persist: bool, as_prepared: bool) -> StepRecord: ...

    def _prepared_again(
        self, rec: StepRecord, files: list[str], coordinator: str, participants: list[str]
    ) -> list[FileRecord]: ...


class Attempts:
    """Mixed into :class:`~tierckpt_daemon.tier.service.TierService`."""

    def prepare_share(
        self: _Service,
        namespace: str,
        step: int,
        attempt: str,
        *,
        files: list[str],
        coordinator: str,
        participants: list[str],
        world_size: int,
    ) -> list[FileRecord]:
        """Prepare this node's share of an attempt: keep only ``files``, checksum them (block
        by block) where the writer did not, record the decider and participants
        (MANIFEST.prepared.json). The same prepare again gets the same answer."""
        svc, key = self, (namespace, step, attempt)
        with svc.lock:
            rec = svc.writing_record(namespace, step, attempt)
            if rec.prepared_at is not None or key in self._preparing:
                return self._prepared_again(rec, files, coordinator, participants)
            svc.keep_only(rec, files)
            # Files the writer sent checksums for keep them (taken right after the copy).
            todo = [
                (f.name, str(rec.dir / f.name), f.length)
                for f in rec.files.values()
                if f.checksum is None or f.blocks is None
            ]
            self._preparing.add(key)
        try:
            # Checksum the share now, off the trainers' stall and right after their copy: the
            # global record carries every file's checksum to peers and the persistent tier.
            sums = {name: checksum_file_blocks(path, length) for name, path, length in todo}
            with svc.lock:
                if svc.index.writing.get(key) is not rec:
                    raise StepStateError(
                        f"{namespace}/step {step}: attempt {attempt} ended while it was prepared"
                    )
                for name, (whole, size, blocks) in sums.items():
                    f = rec.files[name]
                    f.checksum, f.block_size, f.blocks = whole, size, blocks
                rec.coordinator = coordinator
                rec.participants = list(participants)
                rec.world_size = world_size
                rec.prepared_at = time.time()
                for f in rec.files.values():
                    f.node = self.node
                write_prepared(rec)
                return [f.model_copy(update={"size": None}) for f in rec.sorted_files()]
        finally:
            with svc.lock:
                self._preparing.discard(key)

    def _prepared_again(
        self: _Service,
        rec: StepRecord,
        files: list[str],
        coordinator: str,
        participants: list[str],
    ) -> list[FileRecord]:
        """A second prepare of an attempt (caller holds the lock): the same one again gets the
        same answer; any other is refused, so that no one replaces the decider's prepare of an
        attempt in flight (dropping its sealed files, or naming another decider)."""
        same = (
            rec.prepared_at is not None
            and rec.coordinator == coordinator
            and rec.participants == list(participants)
            and sorted(rec.files) == sorted(files)
        )
        if not same:
            raise StepStateError(
                f"{rec.namespace}/step {rec.step}: attempt {rec.attempt} is already "
                + (
                    f"prepared by decider {rec.coordinator} with files {sorted(rec.files)[:8]}"
                    if rec.prepared_at is not None
                    else "being prepared"
                )
                + f"; a prepare by {coordinator} with files {sorted(files)[:8]} is refused"
            )
        return [f.model_copy(update={"size": None}) for f in rec.sorted_files()]

    def take_decision(
        self: _Service, m: StepManifest, *, persist: bool, as_prepared: bool = False
    ) -> StepRecord:
        """Commit this node's share of a step with the decider's global record (idempotent).

        The decision's share table is checked against what this node prepared (its files, the
        participants). ``as_prepared``: a decision with the table's digest only, learnt in doubt
        from a participant while no holder of the table answers (the in-doubt resolver): this
        node's share is what it prepared for this attempt."""
        svc = self
        if m.attempt is None or m.coordinator is None:
            raise ProtocolError(f"{m.namespace}/step {m.step}: a decision without attempt/decider")
        with svc.lock:
            current = svc.index.committed.get(m.namespace, {}).get(m.step)
            same = current is not None and current.attempt == m.attempt
            queue = current is not None and same and _upgrade_persist(current, persist)
            if not same:
                rec = self._take_share(m, persist=persist, as_prepared=as_prepared)
        if current is not None and same:
            if queue:
                logger.info(
                    "%s/step %d: its decision says to persist it: queued for the persistent tier",
                    m.namespace,
                    m.step,
                )
                svc.persist_requested(current)
            return current
        svc.freshness.committed(m.namespace, rec.committed_at, due=rec.persist_pending)
        svc.notify_committed(rec)
        return rec

    def _take_share(
        self: _Service, m: StepManifest, *, persist: bool, as_prepared: bool
    ) -> StepRecord:
        """:meth:`take_decision` of an attempt not committed here yet (caller holds the lock)."""
        svc = self
        assert m.attempt is not None  # take_decision checked it
        rec = svc.writing_record(m.namespace, m.step, m.attempt)
        if rec.prepared_at is None:
            raise StepStateError(
                f"{m.namespace}/step {m.step}: attempt {m.attempt} was never prepared here"
            )
        # Only the decision of the decider that prepared the attempt, over its participants.
        ring = ring_of(m)
        blind = as_prepared and ring is not None and not ring.has_table
        strangers = [] if blind else sorted(set(m.nodes()) - set(rec.participants))
        if m.coordinator != rec.coordinator or (rec.participants and strangers):
            raise StepStateError(
                f"{m.namespace}/step {m.step}: a decision for attempt {m.attempt} by "
                f"{m.coordinator} (files on {', '.join(strangers) or 'its participants'}) "
                f"does not match its prepare by decider {rec.coordinator} with participants "
                f"{', '.join(rec.participants)}: refused"
            )
        mine = set(rec.files) if blind else m.share_names(self.node or "")
        if mine != set(rec.files):
            raise StepStateError(
                f"{m.namespace}/step {m.step}: the decision lists {sorted(mine)} on "
                f"{self.node}, which prepared {sorted(rec.files)}"
            )
        # Of the other nodes' files only their shares' entries are kept (RingRecord), and
        # those only on the step's holders: any other node keeps the table's digest.
        rec.ring = ring.kept_by(self.node) if ring is not None else None
        rec.coordinator = m.coordinator
        rec.participants = []
        rec.prepared_at = None
        rec.world_size = m.world_size
        rec.persist = persist  # the decision, which a participant in doubt may ask for
        rec.learn_checksums({f.name: f.checksum for f in m.files if f.checksum and f.name in mine})
        return svc.install(rec, m.metadata, persist=persist, replicate=True)

    def abort_attempt(self: _Service, namespace: str, step: int, attempt: str) -> None:
        """End an attempt of a commit across nodes (the decider says so, or never decided it)."""
        svc = self
        with svc.lock:
            rec = svc.index.writing.pop((namespace, step, attempt), None)
            if rec is not None:
                logger.warning(
                    "%s/step %d: attempt %s aborted; its files are reclaimed",
                    namespace,
                    step,
                    attempt,
                )
                svc.index.reclaim_dir(rec.dir)

    def attempt_outcome(self: _Service, namespace: str, step: int, attempt: str) -> OutcomeResponse:
        """How this node's part of a save attempt stands (a participant in doubt asks)."""
        svc = self
        with svc.lock:
            for rec in svc.index.records_of(namespace, step):
                if rec.attempt == attempt and rec.state != StepState.WRITING:
                    metadata = read_manifest(rec.manifest_path()).metadata
                    manifest = rec.manifest(metadata).portable()
                    return OutcomeResponse(
                        outcome="committed", manifest=manifest, persist=decided_persist(rec)
                    )
            writing = svc.index.writing.get((namespace, step, attempt))
        if writing is None:
            return OutcomeResponse(outcome="unknown")
        return OutcomeResponse(outcome="prepared" if writing.prepared_at is not None else "writing")


def decided_persist(rec: StepRecord) -> bool:
    """Whether a committed step is to be persisted, as its decision said: the flag taken with
    the decision (a record from before it was kept: what this node's upload work shows). Never
    this node's *remaining* upload work alone: once its own share is up that is False, and a
    participant told so would never upload its share (the step never becomes durable)."""
    if rec.persist is not None:
        return rec.persist
    return rec.persist_pending or rec.state == StepState.DURABLE


def _upgrade_persist(rec: StepRecord, persist: bool) -> bool:
    """A decision taken again for a committed step (caller holds the lock): one that says to
    persist it wins over an earlier ``persist=False`` (taken from a node whose answer was wrong):
    else the step never becomes durable. True when ``rec`` is now to be uploaded."""
    if not persist or rec.persist:
        return False
    rec.persist = True
    if rec.state != StepState.DURABLE:
        rec.persist_pending = True
    update_manifest(rec)
    return rec.persist_pending
