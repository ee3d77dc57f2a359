"""Copies from elsewhere joining the memory tier under the service's lock: files of a step
spanning nodes fetched into leases (a share restored, a peer's share replicated here) added to
this node's record of the step, or a new record of it installed.

:class:`~tierckpt_daemon.tier.service.TierService` inherits this; the fetching itself is
:mod:`tierckpt_daemon.tier.hydration`'s.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from tierckpt_core.errors import LeaseNotFoundError, StepNotFoundError, StepStateError
from tierckpt_core.manifest import FileRecord, StepManifest, ring_of
from tierckpt_daemon.tier.records import StepRecord, update_manifest

if TYPE_CHECKING:
    from tierckpt_daemon.tier.arena import Arena
    from tierckpt_daemon.tier.index import StepIndex
    from tierckpt_daemon.tier.leases import Leases


class Copies:
    lock: threading.RLock
    arena: Arena
    index: StepIndex
    leases: Leases
    node: str | None

    def add_files(self, rec: StepRecord, leased: list[tuple[FileRecord, str]]) -> None:
        """Files of a step spanning nodes, fetched into leases, join this node's record of it (a
        reader here needs them, or they are a replica of a peer's share)."""
        with self.lock:
            if not self.index.holds(rec):  # retention or pressure dropped it during the fetch
                raise StepNotFoundError(
                    f"{rec.namespace}/step {rec.step} left this node's memory while files of it "
                    "were fetched"
                )
            for f, lease_id in leased:
                lease = self.leases.get(rec.namespace, lease_id)
                if lease is None:
                    raise LeaseNotFoundError(f"{rec.namespace}: lease {lease_id} expired")
                # Moved first: a move that fails leaves the lease for the caller to give back.
                self.arena.move(lease.path, rec.dir / f.name)
                self.leases.take(lease)
                rec.files[f.name] = f.model_copy(update={"size": lease.size})
            if rec.manifest_path().exists():
                update_manifest(rec)

    def install_share(
        self,
        manifest: StepManifest,
        leased: list[tuple[FileRecord, str]],
        *,
        owner: str | None,
        origin: str | None,
        hold_until: float | None,
    ) -> StepRecord:
        """A new record of a step spanning nodes, holding the files fetched into ``leased`` and
        knowing the rest by the step's ring record (``manifest``: its global record),
        committed as its writer's attempt."""
        ns, step, attempt = manifest.namespace, manifest.step, manifest.attempt
        assert attempt is not None  # checked by the caller, before any byte moved
        with self.lock:
            self.refuse_copy(ns, step, attempt, owner)
            rec = self.index.begin(ns, step, attempt)
            if rec.files or rec.prepared_at is not None:
                raise StepStateError(f"{ns}/step {step}: attempt {attempt} is being saved here")
            rec.owner = owner
            self.add_files(rec, leased)
            # The rest of the step: its share table (on its holders; elsewhere the table's digest).
            ring = ring_of(manifest)
            rec.ring = ring.kept_by(self.node) if ring is not None else None
            rec.coordinator = manifest.coordinator
            rec.world_size = manifest.world_size
            if hold_until is not None:
                rec.hold_until = hold_until
            return self.install(
                rec,
                manifest.metadata,
                persist=False,
                replicate=False,
                origin=origin,
                copy_of=manifest,
            )

    # The service's own (ownership.py, service.py).
    def refuse_copy(
        self,
        namespace: str,
        step: int,
        attempt: str,
        owner: str | None,
        *,
        besides: StepRecord | None = None,
    ) -> None:
        raise NotImplementedError

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
        raise NotImplementedError
