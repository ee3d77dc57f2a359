"""What the memory tier holds, asked under the service's lock: a step's record, the steps of a
namespace, "latest", the commit record and its metadata, the namespaces, the attempts in doubt;
and the pins that keep a step in memory while a reader copies out of it.

:class:`~tierckpt_daemon.tier.service.TierService` inherits these (its query half; the state
machine the trainers drive is the service itself).
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tierckpt_core.errors import (
    LeaseNotFoundError,
    NamespaceNotFoundError,
    StepNotFoundError,
    StepStateError,
)
from tierckpt_core.manifest import StepManifest
from tierckpt_core.protocol import (
    AttemptInfo,
    NamespaceInfo,
    PinResponse,
    StepInfo,
    StepState,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.tier.index import StepIndex
from tierckpt_daemon.tier.ownership import owned_by
from tierckpt_daemon.tier.records import StepRecord, read_manifest
from tierckpt_daemon.tier.writers import any_alive

if TYPE_CHECKING:
    from tierckpt_daemon.tier.arena import Arena
    from tierckpt_daemon.tier.leases import Leases

PIN_TTL_S = 600.0  # a pin a reader never released lapses after this


@dataclass(frozen=True)
class Usage:
    """The memory tier at one moment (for the status and the /metrics gauges)."""

    capacity_bytes: int
    used_bytes: int
    pool_bytes: int
    pool_files: int
    leased_bytes: int
    bytes_by_state: dict[str, int]  # the steps' states, "retiring", "pool" and "leased"
    steps_by_state: dict[str, int]
    namespaces: list[NamespaceInfo]


class Queries:
    lock: threading.RLock
    index: StepIndex
    lease_ttl_s: float
    arena: Arena
    leases: Leases

    def usage(self) -> Usage:
        """What the tier holds, by state, taken under the lock at once."""
        index = self.index
        with self.lock:
            by_state: dict[str, int] = {st.value: 0 for st in StepState}
            steps: dict[str, int] = {st.value: 0 for st in StepState}
            for rec in index.all_committed():
                by_state[rec.state.value] += rec.bytes
                steps[rec.state.value] += 1
            for rec in index.writing.values():
                by_state[StepState.WRITING.value] += rec.bytes
                steps[StepState.WRITING.value] += 1
            by_state["retiring"] = sum(r.bytes for r in index.retiring)
            by_state["pool"] = self.arena.pool_bytes
            by_state["leased"] = self.leases.held_bytes
            return Usage(
                capacity_bytes=self.arena.capacity_bytes,
                used_bytes=self.arena.used_bytes,
                pool_bytes=self.arena.pool_bytes,
                pool_files=self.arena.pool_files,
                leased_bytes=self.leases.held_bytes,
                bytes_by_state=by_state,
                steps_by_state=steps,
                namespaces=[index.namespace_info(ns) for ns in index.namespaces()],
            )

    # ``owner`` (the reader's identity, see Ownership.acting_owner; None: anyone's): a
    # namespace no trainer of this node saved into yet may hold replicas of several owners'
    # steps, and a reader sees only its own (and those from before owners).
    def record(self, namespace: str, step: int, *, owner: str | None = None) -> StepRecord:
        with self.lock:
            rec = self.index.get(namespace, step)
            if not owned_by(rec.owner, owner):
                raise StepNotFoundError(f"{namespace}/step {step} is not committed in memory")
            return rec

    def records(self, namespace: str, *, owner: str | None = None) -> list[StepRecord]:
        """The committed steps of ``namespace`` in memory, oldest first."""
        validate_namespace(namespace)
        with self.lock:
            steps = sorted(self.index.committed.get(namespace, {}).items())
            return [r for _, r in steps if owned_by(r.owner, owner)]

    def get_step(self, namespace: str, step: int, *, owner: str | None = None) -> StepInfo:
        with self.lock:
            return self.record(namespace, step, owner=owner).info()

    def latest(self, namespace: str, *, owner: str | None = None) -> StepInfo:
        with self.lock:
            recs = self.records(namespace, owner=owner)
            if not recs:
                raise NamespaceNotFoundError(
                    f"namespace {namespace} has no committed step in memory"
                )
            return recs[-1].info()

    def committed_records(self, namespace: str | None = None) -> list[StepRecord]:
        """The committed steps held here (of ``namespace``, or of every one), anyone's."""
        with self.lock:
            return [
                r
                for r in self.index.all_committed()
                if namespace is None or r.namespace == namespace
            ]

    def committed_record(self, namespace: str, step: int) -> StepRecord | None:
        """The committed record of a step held here, anyone's (None if there is none)."""
        with self.lock:
            return self.index.committed.get(namespace, {}).get(step)

    def prepared_attempts(self, *, older_than_s: float) -> list[StepRecord]:
        """Attempts of steps spanning nodes prepared here longer ago than ``older_than_s`` and
        not decided yet (in doubt: their decider is asked how they ended)."""
        cutoff = time.time() - older_than_s
        with self.lock:
            return [
                r
                for r in self.index.writing.values()
                if r.prepared_at is not None and r.prepared_at < cutoff
            ]

    def manifest(self, namespace: str, step: int, *, owner: str | None = None) -> StepManifest:
        """The commit record of a step held here, as written on tmpfs."""
        with self.lock:
            path = self.record(namespace, step, owner=owner).manifest_path()
        return read_manifest(path)

    def metadata(self, namespace: str, step: int, *, owner: str | None = None) -> str:
        """The DCP metadata this node keeps for a step (empty where its holders keep it: see
        :meth:`Restorer.metadata <tierckpt_daemon.tier.restore.Restorer.metadata>`)."""
        return self.manifest(namespace, step, owner=owner).metadata

    def list_namespaces(self, owner: str | None = None) -> list[NamespaceInfo]:
        """The namespaces held here (with ``owner``: those it may reach)."""
        with self.lock:
            return [
                self.index.namespace_info(ns)
                for ns in self.index.namespaces()
                if owner is None or self.index.owner_of(ns) in (None, owner)
            ]

    def list_steps(self, namespace: str, *, owner: str | None = None) -> list[StepInfo]:
        validate_namespace(namespace)
        with self.lock:
            recs = list(self.index.committed.get(namespace, {}).values())
            recs += [r for k, r in self.index.writing.items() if k[0] == namespace]
            recs = [r for r in recs if owned_by(r.owner, owner)]
            if not recs:
                raise NamespaceNotFoundError(f"namespace {namespace} is unknown to this daemon")
            now = time.monotonic()
            return [
                self._writing_info(r, now) if r.state == StepState.WRITING else r.info()
                for r in sorted(recs, key=lambda r: (r.step, r.state.value))
            ]

    # -- save attempts not committed (in progress, or left by a trainer that died mid-save) --
    def _reclaim_in(self, rec: StepRecord, now: float) -> float | None:
        if rec.prepared_at is not None:
            return None  # its decider ends it (peers/commit.py), not the sweep
        return max(0.0, rec.last_activity + self.lease_ttl_s - now)

    def _writing_info(self, rec: StepRecord, now: float) -> StepInfo:
        return rec.info().model_copy(
            update={
                "attempt": rec.attempt,
                "writer_alive": any_alive(rec.writers),
                "reclaim_in_s": self._reclaim_in(rec, now),
            }
        )

    def attempts(self, namespace: str, step: int) -> list[AttemptInfo]:
        """The save attempts of a step not committed yet, oldest first."""
        validate_namespace(namespace)
        validate_step(step)
        now = time.monotonic()
        with self.lock:
            recs = [r for k, r in self.index.writing.items() if k[:2] == (namespace, step)]
            return [
                AttemptInfo(
                    namespace=namespace,
                    step=step,
                    attempt=r.attempt,
                    prepared=r.prepared_at is not None,
                    bytes=r.bytes,
                    files=r.sorted_files(),
                    owner=r.owner,
                    created_at=r.created_at,
                    idle_s=now - r.last_activity,
                    reclaim_in_s=self._reclaim_in(r, now),
                    writers=sorted(r.writers),
                    writer_alive=any_alive(r.writers),
                )
                for r in sorted(recs, key=lambda r: r.created_at)
            ]

    # -- a reader's pins: the step stays in memory while its reader copies out of it --------
    def pin(
        self, namespace: str, step: int, attempt: str | None = None, *, owner: str | None = None
    ) -> PinResponse:
        with self.lock:
            rec = self.record(namespace, step, owner=owner)
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
        with self.lock:
            for rec in self.index.records_of(namespace, step):
                if rec.pins.pop(pin_id, None) is not None:
                    if not rec.pins:
                        rec.hold_until = 0.0  # its reader is done: retention applies again
                    self.index.drop_if_retired(rec)
                    return
            raise LeaseNotFoundError(f"{namespace}/step {step}: no pin {pin_id}")
