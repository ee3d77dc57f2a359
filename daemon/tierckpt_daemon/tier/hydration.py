"""Bring a step into the memory tier from elsewhere (the persistent tier or a peer's replica).

Both sources do the same four things, which live here once: lease an arena file per stored file
(capacity accounting, recycled pool files), fill the files in parallel with a source-specific
``fetch`` that verifies what it wrote, seal them by rank into a new attempt, and commit the step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

from tierckpt_core.errors import (
    CheckpointFormatError,
    NotFoundError,
)
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_core.protocol import CommitRequest, SealFile, SealRequest
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import HOLD_S, TierService

Fetch = Callable[[FileRecord, str], None]
"""``fetch(file, path)``: write ``file``'s bytes into the leased ``path`` and verify them (raise
:class:`~tierckpt_core.errors.IntegrityError` on a mismatch)."""


def fill_step(
    service: TierService,
    namespace: str,
    step: int,
    files: Sequence[FileRecord],
    *,
    copy_of: StepManifest,
    fetch: Fetch,
    pool: Executor,
    attempt_prefix: str,
    replicate: bool,
    origin: str | None = None,
    spanning: StepManifest | None = None,
    hold: bool = False,
    owner: str | None = None,
) -> StepRecord:
    """Lease, fill (``fetch`` on ``pool``), seal and commit ``files`` as ``namespace/step``, a
    copy of the step ``copy_of`` records (its DCP metadata, world size and times kept).

    ``owner``: the identity the step belongs to (its manifest's), refused where the namespace
    belongs to another or where it would replace a save of this node's own
    (:class:`~tierckpt_core.errors.NamespaceOwnerError`).

    ``hold``: the step is brought in for a reader; retention leaves it until the reader has
    unpinned it (or ``HOLD_S`` passed), even when it is older than the steps retention keeps.

    ``spanning`` is the global record of a step whose files lie on several nodes, of which
    ``files`` are the ones to bring here: they join this node's record of the step if it has one
    (same attempt), else a new record holds them and knows the rest by their shares' entries.

    Returns the committed record, with the files' checksums. On any failure every lease is given
    back (after every fetch has ended: none may still write into a pooled file) and the error is
    raised.
    """
    if spanning is not None:
        return _fill_share(
            service, spanning, files, fetch=fetch, pool=pool, origin=origin, hold=hold, owner=owner
        )
    attempt = f"{attempt_prefix}{uuid.uuid4().hex[:15]}"
    service.refuse_copy(namespace, step, attempt, owner)  # before any byte moves
    leases = _lease_and_fetch(service, namespace, files, fetch, pool)
    try:
        by_rank: dict[int, list[SealFile]] = {}
        for f, lease_id in leases:
            by_rank.setdefault(f.rank, []).append(
                SealFile(
                    lease_id=lease_id,
                    name=f.name,
                    length=f.length,
                    # The checksums the bytes were verified against as they were fetched.
                    checksum=f.checksum,
                    block_size=f.block_size if f.checksum and f.blocks else None,
                    blocks=f.blocks if f.checksum else None,
                )
            )
        for rank, seal_files in sorted(by_rank.items()):
            service.seal(
                namespace, step, attempt, SealRequest(rank=rank, files=seal_files), owner=owner
            )
    except BaseException:
        _give_back(service, namespace, leases)
        raise
    if not leases:
        service.seal(namespace, step, attempt, SealRequest(rank=0, files=[]), owner=owner)
    if hold:
        service.writing_record(namespace, step, attempt).hold_until = time.monotonic() + HOLD_S
    service.commit(
        namespace,
        step,
        attempt,
        CommitRequest(
            files=[f.name for f in files],
            metadata=copy_of.metadata,
            world_size=copy_of.world_size or 1,
            persist=False,
        ),
        replicate=replicate,
        origin=origin,
        checksums={f.name: f.checksum for f in files if f.checksum},
        copy_of=copy_of,
    )
    return service.record(namespace, step)


def _fill_share(
    service: TierService,
    manifest: StepManifest,
    files: Sequence[FileRecord],
    *,
    fetch: Fetch,
    pool: Executor,
    origin: str | None,
    hold: bool,
    owner: str | None,
) -> StepRecord:
    ns, step, attempt = manifest.namespace, manifest.step, manifest.attempt
    if attempt is None:
        raise CheckpointFormatError(f"{ns}/step {step}: the global record names no attempt")
    # A restored share has the writer's attempt id, like this node's own saves: refuse here,
    # install cannot tell them apart.
    service.refuse_copy(ns, step, attempt, owner)
    current = service.committed_record(ns, step)
    if current is not None and current.attempt == attempt:
        files = [f for f in files if f.name not in current.files]
    leases = _lease_and_fetch(service, ns, files, fetch, pool)
    try:
        if current is not None and current.attempt == attempt:
            if hold:
                current.hold_until = time.monotonic() + HOLD_S
            service.add_files(current, leases)
            return current
        installed = service.install_share(
            manifest,
            leases,
            owner=owner,
            origin=origin,
            hold_until=time.monotonic() + HOLD_S if hold else None,
        )
    except BaseException:
        _give_back(service, ns, leases)
        raise
    service.notify_committed(installed)
    return installed


def _lease_and_fetch(
    service: TierService, namespace: str, files: Sequence[FileRecord], fetch: Fetch, pool: Executor
) -> list[tuple[FileRecord, str]]:
    leases: list[tuple[FileRecord, str]] = []
    try:
        paths = []
        for f in files:
            # No pre-faulting: the fetch writes every byte, which faults the pages in once.
            lease = service.lease(namespace, f.rank, f.length, prefault=False)
            leases.append((f, lease.lease_id))
            paths.append(lease.path)
        futures = [pool.submit(fetch, f, path) for f, path in zip(files, paths, strict=True)]
        concurrent.futures.wait(futures)
        for fut in futures:
            fut.result()
    except BaseException:
        _give_back(service, namespace, leases)
        raise
    return leases


def _give_back(service: TierService, namespace: str, leases: list[tuple[FileRecord, str]]) -> None:
    for _, lease_id in leases:
        # A lease already sealed into the attempt is reclaimed by the sweeper.
        with contextlib.suppress(NotFoundError):
            service.release_lease(namespace, lease_id)
