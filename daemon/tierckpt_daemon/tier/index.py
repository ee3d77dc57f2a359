"""The daemon's step tables: which steps are committed, being written or retiring, per namespace,
and their rebuild from the tier directory after a (re)start.

The tier directory is the journal (see :mod:`tierckpt_daemon.tier.records`): a step directory with a
commit record is committed, anything else found at start is a save that never finished, and its
files go back to the pool. A retired step leaves the tables at once but keeps its files until no
reader pins it and nothing (upload, replication) still needs it; then :meth:`StepIndex.drop` gives
them to the pool.

Not thread-safe by itself: :class:`~tierckpt_daemon.tier.service.TierService` holds its lock around
every call.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from tierckpt_core.errors import (
    CheckpointFormatError,
    NamespaceNotFoundError,
    StepNotFoundError,
    StepStateError,
)
from tierckpt_core.protocol import NamespaceInfo, StepState, validate_namespace, validate_step
from tierckpt_daemon.tier.arena import Arena, foreign, make_dir, new_dir, ours, own_dir
from tierckpt_daemon.tier.eviction import EvictionPolicy, safe_to_evict
from tierckpt_daemon.tier.records import (
    MANIFEST,
    PREPARED,
    StepRecord,
    committed_here,
    parse_step_dir_name,
    read_manifest,
    record_from_manifest,
    step_dir_name,
)

logger = logging.getLogger(__name__)


class StepIndex:
    def __init__(self, arena: Arena, policy: EvictionPolicy) -> None:
        self.arena = arena
        self.policy = policy
        self.committed: dict[str, dict[int, StepRecord]] = {}
        self.writing: dict[tuple[str, int, str], StepRecord] = {}
        self.retiring: list[StepRecord] = []  # out of the tables, waiting for readers to unpin
        self.damaged_records = 0  # committed steps whose commit record a rebuild could not read

    # -- rebuild ----------------------------------------------------------------------------
    def rebuild(self) -> list[StepRecord]:
        """Rebuild the tables from the tier directory; returns the steps retention retired (a
        crash between a commit and its retention leaves one step too many)."""
        self.arena.scan_pool()
        reclaimed = 0
        for p in sorted(self.arena.lease_dir.iterdir()):
            self.arena.adopt_into_pool(p)
            reclaimed += 1
        for ns_dir in sorted(self.arena.ns_dir.iterdir()):
            if not _is_real_dir(ns_dir):  # a link or a file planted in ns/: removed, not followed
                self.arena.delete(ns_dir)
                continue
            if not _made_ours(ns_dir):
                continue
            for step_dir in sorted(ns_dir.iterdir()):
                if _is_real_dir(step_dir) and not _made_ours(step_dir):
                    continue
                reclaimed += self._rebuild_step(ns_dir.name, step_dir)
            if not any(ns_dir.iterdir()):
                ns_dir.rmdir()
        retired = []
        for ns, steps in self.committed.items():
            owners: set[str | None] = {r.owner for r in steps.values()} - {None}
            victims = {id(v): v for o in owners or {None} for v in self.retention(ns, o)}
            for victim in victims.values():
                self.retire(victim)
                retired.append(victim)
            logger.info("namespace %s: committed steps %s", ns, sorted(steps))
        logger.info(
            "index rebuilt from %s: %d committed steps, %d partial files reclaimed, %d pool files",
            self.arena.root,
            sum(len(s) for s in self.committed.values()),
            reclaimed,
            self.arena.pool_files,
        )
        return retired

    def _rebuild_step(self, namespace: str, step_dir: Path) -> int:
        manifest = step_dir / MANIFEST
        real = _is_real_dir(step_dir)
        if real and _is_real_file(manifest) and parse_step_dir_name(step_dir.name):
            try:
                _check_owner(manifest)
                rec = record_from_manifest(namespace, step_dir, read_manifest(manifest))
            except CheckpointFormatError as e:
                # A committed step whose record is damaged: its files cannot be verified any
                # more (the record holds their checksums), so they cannot be served. Said as the
                # corruption it is, not as an unfinished save.
                self.damaged_records += 1
                logger.error(
                    "%s/%s: the commit record of this committed step is damaged (%s): its files "
                    "cannot be verified and leave memory; where it is durable or replicated, "
                    "it is read from there",
                    namespace,
                    step_dir.name,
                    e,
                )
                n = self.reclaim_dir(step_dir)
                logger.info("%d files of %s/%s go to the pool", n, namespace, step_dir.name)
                return n
            else:
                for f in rec.files.values():
                    self.arena.track(step_dir / f.name, f.held_bytes)
                steps = self.committed.setdefault(namespace, {})
                old = steps.get(rec.step)
                # Two committed attempts of one step survive a crash mid-supersede: newest wins.
                if old is None or (old.committed_at or 0) < (rec.committed_at or 0):
                    steps[rec.step] = rec
                    if old is not None:
                        self.drop(old)
                else:
                    self.drop(rec)
                return 0
        prepared = step_dir / PREPARED
        if real and _is_real_file(prepared) and parse_step_dir_name(step_dir.name):
            try:
                _check_owner(prepared)
                rec = record_from_manifest(namespace, step_dir, read_manifest(prepared))
            except CheckpointFormatError as e:
                logger.warning("discarding prepared step directory %s: %s", step_dir, e)
            else:
                # Prepared for a commit across nodes, decision unknown: keep it, in doubt, until
                # the decider (or another participant) says how it ended.
                doc = read_manifest(prepared)
                rec.state = StepState.WRITING
                rec.prepared_at = time.time()
                rec.participants = list((doc.local and doc.local.participants) or [])
                for f in rec.files.values():
                    self.arena.track(step_dir / f.name, f.held_bytes)
                self.writing[(namespace, rec.step, rec.attempt)] = rec
                logger.warning(
                    "%s/step %d: attempt %s was prepared for a commit across nodes before the "
                    "restart; asking its coordinator %s how it ended",
                    namespace,
                    rec.step,
                    rec.attempt,
                    rec.coordinator,
                )
                return 0
        n = self.reclaim_dir(step_dir)
        logger.info("reclaimed %d files of unfinished save %s/%s", n, namespace, step_dir.name)
        return n

    def reclaim_dir(self, step_dir: Path) -> int:
        """Give the files of an uncommitted step directory to the pool and remove it."""
        n = 0
        if _is_real_dir(step_dir):
            for p in list(step_dir.iterdir()):
                if p.name.startswith(MANIFEST):
                    p.unlink()
                else:
                    self.arena.adopt_into_pool(p)  # removes anything that is not a plain file
                    n += 1
            step_dir.rmdir()
        else:
            step_dir.unlink(missing_ok=True)  # a link itself, never its target
        return n

    # -- writing ----------------------------------------------------------------------------
    def begin(self, namespace: str, step: int, attempt: str) -> StepRecord:
        """The record of save attempt ``attempt`` of ``step``, started now if it is new (which
        discards any other unfinished attempt of the step)."""
        key = (namespace, step, attempt)
        rec = self.writing.get(key)
        if rec is None:
            done = self.committed.get(namespace, {}).get(step)
            if done is not None and done.attempt == attempt:
                raise StepStateError(
                    f"{namespace}/step {step}: attempt {attempt} is already committed; a new save "
                    "of the step needs a new attempt"
                )
            for other in [k for k in self.writing if k[0] == namespace and k[1] == step]:
                old = self.writing.pop(other)
                logger.warning(
                    "%s/step %d: discarding unfinished save attempt %s, a new attempt started",
                    namespace,
                    step,
                    old.attempt,
                )
                self.reclaim_dir(old.dir)
            step_dir = self.arena.ns_dir / namespace / step_dir_name(step, attempt)
            make_dir(step_dir.parent)
            try:
                own_dir(step_dir.parent)  # one another user planted (when the tier was 0770)
            except PermissionError as e:
                raise StepStateError(f"{namespace}: {e}: remove it to save here") from None
            new_dir(step_dir)
            rec = StepRecord(namespace=namespace, step=step, attempt=attempt, dir=step_dir)
            self.writing[key] = rec
        return rec

    def abandon(self, rec: StepRecord) -> None:
        """Drop the unfinished save attempt ``rec``; its sealed files go to the pool."""
        del self.writing[(rec.namespace, rec.step, rec.attempt)]
        self.reclaim_dir(rec.dir)

    def install(self, rec: StepRecord) -> tuple[StepRecord | None, list[StepRecord]]:
        """Make the just-committed ``rec`` its step's record; returns the attempt it superseded
        (retired) and the steps retention retired."""
        del self.writing[(rec.namespace, rec.step, rec.attempt)]
        steps = self.committed.setdefault(rec.namespace, {})
        old = steps.get(rec.step)
        steps[rec.step] = rec
        if old is not None:
            self.retire(old)
        victims = self.retention(rec.namespace, rec.owner)
        for victim in victims:
            self.retire(victim)
        return old, victims

    def retention(self, namespace: str, owner: str | None) -> list[StepRecord]:
        """The steps of ``owner`` (and those from before owners) that retention lets go. Each
        owner's steps are counted apart: a namespace no trainer of this node claimed yet may hold
        copies of several owners' steps, and one owner's (far newer) steps must never retire
        another's."""
        steps = self.committed.get(namespace, {}).values()
        return self.policy.after_commit([r for r in steps if _same_tenant(r.owner, owner)])

    # -- leaving memory ---------------------------------------------------------------------
    def retire(self, rec: StepRecord) -> None:
        """Take ``rec`` out of the tables; its files go to the pool once nothing holds it."""
        steps = self.committed.get(rec.namespace, {})
        if steps.get(rec.step) is rec:
            del steps[rec.step]
        # No longer committed from now on, also across a restart (its files may stay a while
        # for the readers that pin it).
        rec.manifest_path().unlink(missing_ok=True)
        if safe_to_evict(rec):
            self.drop(rec)
        else:
            rec.evict_pending = True
            self.retiring.append(rec)

    def evict(self, rec: StepRecord, *, to_pool: bool) -> None:
        """Take ``rec`` out of memory now (memory pressure)."""
        steps = self.committed.get(rec.namespace, {})
        if steps.get(rec.step) is rec:
            del steps[rec.step]
        self.drop(rec, to_pool=to_pool)

    def drop_if_retired(self, rec: StepRecord) -> None:
        if rec.evict_pending and safe_to_evict(rec):
            self.drop(rec)

    def drop(self, rec: StepRecord, *, to_pool: bool = True) -> None:
        manifest = rec.manifest_path()
        manifest.unlink(missing_ok=True)  # first: a crash from here on leaves an uncommitted dir
        for f in rec.files.values():
            if to_pool:
                self.arena.adopt_into_pool(rec.dir / f.name, (rec.namespace, f.rank))
            else:
                self.arena.delete(rec.dir / f.name)
        self.reclaim_dir(rec.dir)
        ns_dir = rec.dir.parent
        if ns_dir.exists() and not any(ns_dir.iterdir()):
            ns_dir.rmdir()
        if rec in self.retiring:
            self.retiring.remove(rec)

    def pressure_victim(self) -> StepRecord | None:
        """The committed step the policy gives up first when the tier is full, if any."""
        candidates: list[StepRecord] = []
        for steps in self.committed.values():
            candidates.extend(self.policy.under_pressure(list(steps.values())))
        candidates.sort(key=lambda r: r.committed_at or 0)
        return candidates[0] if candidates else None

    # -- lookups ----------------------------------------------------------------------------
    def get(self, namespace: str, step: int) -> StepRecord:
        validate_namespace(namespace)
        validate_step(step)
        steps = self.committed.get(namespace)
        if not steps:
            raise NamespaceNotFoundError(f"namespace {namespace} has no committed steps in memory")
        rec = steps.get(step)
        if rec is None:
            raise StepNotFoundError(
                f"{namespace}/step {step} is not committed in memory (committed: "
                f"{sorted(steps)[-8:]})"
            )
        return rec

    def records_of(self, namespace: str, step: int) -> Iterator[StepRecord]:
        """The committed record of ``namespace/step`` and its retiring attempts."""
        rec = self.committed.get(namespace, {}).get(step)
        if rec is not None:
            yield rec
        yield from (r for r in self.retiring if r.namespace == namespace and r.step == step)

    def holds(self, rec: StepRecord) -> bool:
        """``rec`` is still one of this index's records (being written, committed, or retiring
        while readers pin it): not dropped, its directory in place."""
        return (
            self.committed.get(rec.namespace, {}).get(rec.step) is rec
            or self.writing.get((rec.namespace, rec.step, rec.attempt)) is rec
            or any(r is rec for r in self.retiring)
        )

    def all_committed(self) -> list[StepRecord]:
        return [r for steps in self.committed.values() for r in steps.values()]

    def owner_of(self, namespace: str, *, besides: StepRecord | None = None) -> str | None:
        """The identity ``namespace`` belongs to on this node: the owner that this node's own
        saves of it (committed or being written; ``besides`` left out) record; None while it has
        none here, or only steps from before owners. Copies from elsewhere (replicas, restores)
        never claim a namespace: a peer's push of another uid's steps would lock this node's
        own trainers out of it."""
        recs = [*self.committed.get(namespace, {}).values()]
        recs += [r for k, r in self.writing.items() if k[0] == namespace]
        return next(
            (
                r.owner
                for r in recs
                if r.owner is not None and r is not besides and committed_here(r)
            ),
            None,
        )

    def namespaces(self) -> list[str]:
        return sorted(set(self.committed) | {k[0] for k in self.writing})

    def namespace_info(self, ns: str) -> NamespaceInfo:
        committed = self.committed.get(ns, {})
        writing = [r for k, r in self.writing.items() if k[0] == ns]
        return NamespaceInfo(
            namespace=ns,
            steps=len(committed) + len(writing),
            committed_steps=len(committed),
            bytes=sum(r.bytes for r in committed.values()) + sum(r.bytes for r in writing),
            latest_committed=max(committed) if committed else None,
        )


def _same_tenant(a: str | None, b: str | None) -> bool:
    """Whether steps of owners ``a`` and ``b`` count together (None: from before owners)."""
    return a is None or b is None or a == b


def _check_owner(record: Path) -> None:
    """A commit record is the daemon's own file: one another user put there (while the tier was
    0770) is damage, never adopted (its checksums would vouch for whatever it names)."""
    st = os.lstat(record)
    if not ours(st):
        raise CheckpointFormatError(f"{record.name} {foreign(st)}")


def _made_ours(path: Path) -> bool:
    """:func:`own_dir` at a rebuild: a directory of the daemon's gets DIR_MODE (an earlier
    daemon's 0770 let its group replace entries); one another user owns is left out, never
    adopted (it could only have been planted), with an ERROR for the operator."""
    try:
        own_dir(path)
    except PermissionError as e:
        logger.error("left out of the tier's index: %s (planted? remove it)", e)
        return False
    return True


def _is_real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _is_real_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
