"""Where a save's files go: the seam the writer holds.

A writer holds one target, as torch's ``FileSystemWriter`` holds its ``fs``: the node's memory
tier through its daemon (:class:`MemoryTier`), or, when the daemon cannot be used, the persistent
tier straight from the trainer (``_direct.PersistentTier``). Both speak one small protocol, so
``write_data`` reads as one path; which target a save uses is decided once per save (the
coordinator's global plan). A load reads through ``sources`` instead (see ``read_plan``).

Save: ``new_file`` (a file to fill: leased tier memory, or private memory) → the rank fills it →
``write`` (seal the rank's files into the save attempt, or upload them) → the coordinator's
``commit``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena
from tierckpt_core.errors import (
    NotFoundError,
    StepStateError,
    TierCkptError,
)
from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.protocol import CommitRequest, SealFile

logger = logging.getLogger(__name__)


@dataclass
class OutFile:
    """A file a rank fills for a save: leased from the daemon's memory tier (``lease_id`` and
    ``path``), or private memory (``private``) for a save that goes to the persistent tier.

    Only the path of a leased file is kept (and pickled: PROCESS-mode ``async_save`` hands the file
    to DCP's helper process), so each process maps it through its own mapping cache.

    ``lock_fd``: a claimed pre-lease (``_prelease``) holds ``flock`` on its file through this
    descriptor until the file is sealed or given back (:meth:`unlock`), so that the daemon does not
    take it back meanwhile; it is not pickled.
    """

    name: str
    length: int  # bytes of the file the save uses
    lease_id: str | None = None
    path: str | None = None
    private: _arena.FileMapping | None = None
    segments: list[tuple[int, int, str]] | None = None  # see FileRecord.segments
    lock_fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "lock_fd": None}

    def unlock(self) -> None:
        """Let the daemon manage the file again (it was sealed, or is given back)."""
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            os.close(fd)

    def mapping(self) -> _arena.FileMapping:
        if self.path is not None:
            return _arena.map_file(self.path)
        assert self.private is not None
        return self.private


def bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy."""
    array: Any = t.numpy()
    return memoryview(array).cast("B")


def private_file(name: str, size: int) -> OutFile:
    """A file in this process's memory, for a save the persistent tier receives."""
    buffer = torch.empty(size, dtype=torch.uint8)
    return OutFile(name, size, private=_arena.FileMapping(-1, -1, -1, size, buffer))


class SaveTarget(Protocol):
    def begin(self, namespace: str, step: int) -> None:
        """Coordinator, before any rank writes."""

    def new_file(self, namespace: str, rank: int, name: str, size: int) -> OutFile: ...

    def write(
        self, namespace: str, step: int, attempt: str, rank: int, files: list[OutFile]
    ) -> None:
        """Hand the rank's filled files to the target (even none: the rank took part)."""

    def commit(self, namespace: str, step: int, attempt: str, req: CommitRequest) -> None: ...


def overwrite_refused(namespace: str, step: int) -> StepStateError:
    return StepStateError(
        f"{namespace}/step {step} is already committed and the save asked not to replace it "
        "(overwrite=False); save under a new step, or pass overwrite=True"
    )


class MemoryTier:
    """The node's memory tier, through its daemon: files are leased tmpfs files, sealed into a save
    attempt and committed by the coordinator (a load reads it through ``sources.memory``)."""

    def __init__(
        self,
        daemon: DaemonClient,
        *,
        overwrite: bool = True,
    ) -> None:
        self.daemon = daemon
        self.overwrite = overwrite

    # -- save -------------------------------------------------------------------------------
    def begin(self, namespace: str, step: int) -> None:
        """The daemon keeps each save attempt apart until its commit. With ``overwrite=False`` a
        step that exists in any tier is refused here, before any rank writes; the daemon checks
        again in the commit itself, so two racing saves cannot both replace it."""
        if self.overwrite:
            return
        try:
            candidates = self.daemon.candidates(namespace)
        except NotFoundError:  # the namespace's first save
            return
        if any(c.step == step for c in candidates):
            raise overwrite_refused(namespace, step)

    def new_file(self, namespace: str, rank: int, name: str, size: int) -> OutFile:
        lease = self.daemon.lease(namespace, rank, size)
        f = OutFile(name, lease.size, lease_id=lease.lease_id, path=lease.path)
        try:
            f.mapping()
        except BaseException:
            self.discard(namespace, f)
            raise
        return f

    def write(
        self, namespace: str, step: int, attempt: str, rank: int, files: list[OutFile]
    ) -> None:
        seal = []
        for f in files:
            assert f.lease_id is not None, "the memory tier seals only files it leased"
            # Checksummed here, right after the copy and off the trainer's stall (write_data
            # runs in async_save's background): the one checksum that readers, peers and the
            # persistent tier verify these bytes against from now on.
            whole, size, blocks = checksum_blocks(bytes_view(f.mapping().buffer[: f.length]))
            seal.append(
                SealFile(
                    lease_id=f.lease_id,
                    name=f.name,
                    length=f.length,
                    segments=f.segments,
                    checksum=whole,
                    block_size=size,
                    blocks=blocks,
                )
            )
        # Sealed even when empty: the attempt must exist on the daemon for the commit.
        try:
            self.daemon.seal(namespace, step, attempt, rank, seal)
        finally:
            for f in files:
                f.unlock()

    def commit(self, namespace: str, step: int, attempt: str, req: CommitRequest) -> None:
        self.daemon.commit(namespace, step, attempt, req)

    def discard(self, namespace: str, f: OutFile) -> None:
        """Give back a leased file the save will not seal (private memory needs nothing)."""
        if f.lease_id is None:
            return
        try:
            self.daemon.release(namespace, f.lease_id)
        except TierCkptError as e:
            # The lease expires on the daemon by itself; the save's own error is the one to raise.
            logger.warning("%s: could not release lease %s: %s", namespace, f.lease_id, e)
        finally:
            f.unlock()
