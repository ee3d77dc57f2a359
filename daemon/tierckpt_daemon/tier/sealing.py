"""Sealing: a rank's leased files move into its save attempt's step directory, each checked
against its lease (the caller's, big enough) and its claimed checksums (well formed), before any
of them moves; the namespace's first save here claims it for the caller.

:class:`~tierckpt_daemon.tier.service.TierService` inherits this; the leases themselves are
:mod:`tierckpt_daemon.tier.leases`, the commit that follows is the service's.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from tierckpt_core.errors import LeaseNotFoundError, ProtocolError, StepStateError
from tierckpt_core.integrity import check_digests
from tierckpt_core.manifest import FileRecord
from tierckpt_core.protocol import (
    SealRequest,
    StepInfo,
    validate_file_name,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.tier.arena import round_up
from tierckpt_daemon.tier.records import MANIFEST
from tierckpt_daemon.tier.writers import note_writer

if TYPE_CHECKING:
    from tierckpt_daemon.tier.arena import Arena
    from tierckpt_daemon.tier.index import StepIndex
    from tierckpt_daemon.tier.leases import Leases

logger = logging.getLogger(__name__)

CUT_BELOW = 20  # a sealed file is cut to its length when that frees more than 1/20 of it


class _Service(Protocol):
    """What sealing uses of the service it is mixed into."""

    lock: threading.RLock
    arena: Arena
    index: StepIndex
    leases: Leases

    def claim(self, namespace: str, identity: str | None, *, admin: bool = False) -> str | None: ...


class Sealing:
    """Mixed into :class:`~tierckpt_daemon.tier.service.TierService`."""

    def seal(
        self: _Service,
        namespace: str,
        step: int,
        attempt: str,
        req: SealRequest,
        *,
        owner: str | None = None,
        admin: bool = False,
        pid: int | None = None,
    ) -> StepInfo:
        """Seal a rank's files into a save attempt. ``owner``: the identity the save is for (the
        caller's; a copy's owner), which the namespace's first save here claims; ``admin``
        saves into a namespace of another owner on its behalf; ``pid``: the sealing process
        (an operator frees the attempt only once no writer runs: see writers.py)."""
        validate_namespace(namespace)
        validate_step(step)
        validate_file_name(attempt)
        with self.lock:
            caller = owner
            owner = self.claim(namespace, owner, admin=admin)
            # Every lease is the caller's before the attempt begins: a refused seal must not
            # leave a record behind, which would claim the namespace for the caller.
            for f in req.files:
                if self.leases.get(namespace, f.lease_id, caller, admin=admin) is None:
                    raise _unknown_lease(namespace, step, req.rank, f.lease_id, f.name)
            rec = self.index.begin(namespace, step, attempt)
            if rec.owner is None:
                rec.owner = owner
            for f in req.files:
                validate_file_name(f.name)
                if f.name.startswith(MANIFEST):
                    raise StepStateError(f"file name {f.name!r} is reserved")
                lease = self.leases.get(namespace, f.lease_id, caller, admin=admin)
                if lease is None:  # the same lease named twice
                    raise _unknown_lease(namespace, step, req.rank, f.lease_id, f.name)
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
                if f.checksum is not None:
                    problem = check_digests(f.length, f.checksum, f.block_size, f.blocks)
                    if problem:
                        raise ProtocolError(f"{namespace}/step {step}: file {f.name}: {problem}")
                elif f.block_size is not None or f.blocks is not None:
                    raise ProtocolError(
                        f"{namespace}/step {step}: file {f.name}: block checksums without a checksum"
                    )
                if not _regular(lease.path):
                    raise StepStateError(
                        f"{namespace}/step {step}: the file leased for {f.name} was replaced by "
                        "something other than a regular file; the save must lease again"
                    )
                self.leases.take(lease)
                path = rec.dir / f.name
                self.arena.move(lease.path, path)
                # Only the bytes the save references stay: a writer that staged more than its
                # rank writes (replicated state, see docs/design.md) seals a shorter length. A
                # tail under 1/20 stays: the file then still fits the next lease of its size
                # when it is recycled (a plain save leases a little more than it fills).
                size = lease.size
                if round_up(f.length) < size - size // CUT_BELOW:
                    size = self.arena.shrink(path, round_up(f.length))
                rec.files[f.name] = FileRecord(
                    name=f.name,
                    rank=req.rank,
                    size=size,
                    length=f.length,
                    segments=f.segments,
                    checksum=f.checksum,
                    block_size=f.block_size,
                    blocks=f.blocks,
                )
            rec.last_activity = time.monotonic()
            note_writer(rec.writers, pid)
            logger.debug(
                "%s/step %d attempt %s: rank %d sealed %d files",
                namespace,
                step,
                attempt,
                req.rank,
                len(req.files),
                extra=step_fields(namespace, step, attempt, rank=req.rank),
            )
            return rec.info()


def _unknown_lease(
    namespace: str, step: int, rank: int, lease_id: str, name: str
) -> LeaseNotFoundError:
    return LeaseNotFoundError(
        f"{namespace}/step {step} rank {rank}: lease {lease_id} for file {name} is unknown or "
        "expired, or another user's (was the daemon restarted during the save?)"
    )


def _regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself (not a link, socket or FIFO put in its place):
    a seal moves the leased file into the step, and must never move anything else."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
