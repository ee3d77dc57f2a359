"""Bring a step into the memory tier from elsewhere (the persistent tier or a peer's replica).

Both sources do the same four things, which live here once: lease an arena file per stored file
(capacity accounting, recycled pool files), fill the files in parallel with a source-specific
``fetch`` that verifies what it wrote, seal them by rank into a new attempt, and commit the step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any

from tierckpt_core.errors import NotFoundError
from tierckpt_core.manifest import FileRecord
from tierckpt_core.protocol import CommitRequest, SealFile, SealRequest
from tierckpt_daemon.records import StepRecord
from tierckpt_daemon.service import TierService

Fetch = Callable[[FileRecord, str], None]
"""``fetch(file, path)``: write ``file``'s bytes into the leased ``path`` and verify them (raise
:class:`~tierckpt_core.errors.IntegrityError` on a mismatch)."""


def fill_step(
    service: TierService,
    namespace: str,
    step: int,
    files: Sequence[FileRecord],
    *,
    metadata: dict[str, Any],
    world_size: int | None,
    fetch: Fetch,
    pool: Executor,
    attempt_prefix: str,
    replicate: bool,
    origin: str | None = None,
) -> StepRecord:
    """Lease, fill (``fetch`` on ``pool``), seal and commit ``files`` as ``namespace/step``.

    Returns the committed record, with the files' checksums. On any failure every lease is given
    back (after every fetch has ended: none may still write into a pooled file) and the error is
    raised.
    """
    attempt = f"{attempt_prefix}{uuid.uuid4().hex[:15]}"
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
        by_rank: dict[int, list[SealFile]] = {}
        for f, lease_id in leases:
            by_rank.setdefault(f.rank, []).append(
                SealFile(lease_id=lease_id, name=f.name, length=f.length)
            )
        for rank, seal_files in sorted(by_rank.items()):
            service.seal(namespace, step, attempt, SealRequest(rank=rank, files=seal_files))
    except BaseException:
        for _, lease_id in leases:
            # A lease already sealed into the attempt is reclaimed by the sweeper.
            with contextlib.suppress(NotFoundError):
                service.release_lease(namespace, lease_id)
        raise
    if not leases:
        service.seal(namespace, step, attempt, SealRequest(rank=0, files=[]))
    service.commit(
        namespace,
        step,
        attempt,
        CommitRequest(
            files=[f.name for f in files],
            metadata=metadata,
            world_size=world_size or 1,
            persist=False,
        ),
        replicate=replicate,
        origin=origin,
        checksums={f.name: f.checksum for f in files if f.checksum},
    )
    return service.record(namespace, step)
