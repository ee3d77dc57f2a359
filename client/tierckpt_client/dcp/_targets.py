"""Where a save's files go and a load's files come from: the seam the writer and reader hold.

A writer or reader holds one target, as torch's ``FileSystemWriter`` holds its ``fs``: the node's
memory tier through its daemon (:class:`MemoryTier`), or, when the daemon cannot be used, the
persistent tier straight from the trainer (``_direct.PersistentTier``). Both speak the same two
small protocols, so ``write_data`` and the reader's file access read as one path; which target a
save uses is decided once per save (the coordinator's global plan), and a load switches to the
persistent tier only when its daemon cannot be reached.

Save: ``new_file`` (a file to fill: leased tier memory, or private memory) → the rank fills it →
``write`` (seal the rank's files into the save attempt, or upload them) → the coordinator's
``commit``. Load: ``newest_good_step`` → ``metadata`` → ``open_files``.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._files import Files, StepFiles
from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_client.errors import (
    CheckpointFormatError,
    NotFoundError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
)
from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.protocol import CommitRequest, SealFile, StepCandidate

logger = logging.getLogger(__name__)

# A rank that needs at most this much of a file another node holds fetches just those ranges.
RANGED_READ_MAX = 4 << 20


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


class ReadSource(Protocol):
    def newest_good_step(self, namespace: str, below: int | None = None) -> int:
        """The newest step (older than ``below``) that is complete and verifies."""
        ...

    def metadata(self, namespace: str, step: int) -> dict[str, Any]: ...

    def open_files(
        self, namespace: str, step: int, refs: list[ShardRef]
    ) -> contextlib.AbstractContextManager[StepFiles]: ...


class RemoteFiles(Protocol):
    """Files of a step that other nodes hold, read from them straight into the tensors
    (``_peered.PeerTier``)."""

    def files(self, where: str, names: set[str] | None, rest: Files) -> StepFiles: ...


class MemoryTier:
    """The node's memory tier, through its daemon: files are leased tmpfs files, sealed into a save
    attempt and committed by the coordinator; reads map pinned files."""

    def __init__(
        self,
        daemon: DaemonClient,
        *,
        overwrite: bool = True,
        verify_reads: bool = True,
        read_direct: Callable[[str, StepCandidate], dict[str, Any] | None] | None = None,
        peer_files: Callable[[str, int], RemoteFiles | None] | None = None,
    ) -> None:
        self.daemon = daemon
        self.overwrite = overwrite
        self.verify_reads = verify_reads
        # For a step not in this node's memory: the reader's offer to read it straight from
        # the peers that hold it or the persistent tier (returns its metadata, None to
        # decline), instead of the daemon hydrating it first.
        self.read_direct = read_direct
        # For files of a step spanning nodes that other nodes hold and a rank needs in bulk: the
        # reader's offer to read them from those nodes straight into the tensors (None to
        # decline), instead of the daemon bringing them into this node's memory first.
        self.peer_files = peer_files
        self.read_peers = False  # the last open_files read files from the peers

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

    # -- load -------------------------------------------------------------------------------
    def newest_good_step(self, namespace: str, below: int | None = None) -> int:
        """The newest step in memory or durable (older than ``below``) that is complete and
        verifies; older ones are tried when a newer one is corrupt or incomplete, with a warning
        naming the step."""
        skipped: list[str] = []
        for cand in self.daemon.candidates(namespace):
            if below is not None and cand.step >= below:
                continue
            if cand.in_memory:
                return cand.step
            try:
                if self._direct(cand, namespace) is not None:
                    return cand.step
                self.daemon.hydrate(namespace, cand.step)
            except (CheckpointFormatError, NotFoundError) as e:
                logger.warning("%s: skipping step %d for an older one: %s", namespace, cand.step, e)
                skipped.append(f"step {cand.step}: {e}")
                continue
            return cand.step
        older = f" older than step {below}" if below is not None else ""
        raise StepNotFoundError(
            f"namespace {namespace}: no step{older} could be restored ({'; '.join(skipped)})"
        )

    def metadata(self, namespace: str, step: int) -> dict[str, Any]:
        """The step's metadata; the daemon first brings the step into memory (from a peer or the
        persistent tier) if it is not there."""
        try:
            return self.daemon.metadata(namespace, step)
        except NotFoundError:
            if self.read_direct is not None:
                cand = next((c for c in self.daemon.candidates(namespace) if c.step == step), None)
                doc = self._direct(cand, namespace) if cand is not None else None
                if doc is not None:
                    return doc
            self.daemon.hydrate(namespace, step)
            return self.daemon.metadata(namespace, step)

    def _direct(self, cand: StepCandidate, namespace: str) -> dict[str, Any] | None:
        """The metadata of ``cand`` if the reader reads it straight from where it is (peers,
        the persistent tier) rather than from this node's memory."""
        if self.read_direct is None or cand.in_memory:
            return None
        return self.read_direct(namespace, cand)

    @contextlib.contextmanager
    def open_files(self, namespace: str, step: int, refs: list[ShardRef]) -> Iterator[StepFiles]:
        """The step's files in this node's memory, pinned meanwhile. Of a step spanning nodes,
        files that other nodes hold and that ``refs`` (what this rank reads) need: read from
        those nodes straight into the tensors (``peer_files``), else whole into this node's
        memory first; when the rank needs only a little of one (a replicated scalar written by a
        rank on another node), just those ranges, fetched in blocks the daemon verifies."""
        daemon = self.daemon
        needed = {ref.file for ref in refs}
        try:
            pin = daemon.pin(namespace, step)
        except NotFoundError:  # evicted since read_metadata, or another node: bring it back
            daemon.hydrate(namespace, step)
            pin = daemon.pin(namespace, step)
        fetched = needed - set(pin.paths)
        wants: dict[str, list[tuple[int, int]]] = {}
        for ref in refs:
            if ref.file in fetched:
                wants.setdefault(ref.file, []).append((ref.offset, ref.length))
        whole = {n for n, r in wants.items() if sum(length for _, length in r) > RANGED_READ_MAX}
        remote = self.peer_files(namespace, step) if whole and self.peer_files else None
        self.read_peers = remote is not None
        if remote is not None:
            logger.info(
                "%s/step %d: reading %s, held by other nodes, from them straight into the tensors",
                namespace,
                step,
                ", ".join(sorted(whole)[:8]),
            )
        if whole and remote is None:  # needed in bulk: the daemon brings them here first
            daemon.unpin(namespace, step, pin.pin_id)
            daemon.hydrate(namespace, step, sorted(whole))
            pin = daemon.pin(namespace, step)
        ranged: dict[str, dict[tuple[int, int], bytes]] = {}
        for name, ranges in wants.items():
            if name in whole:
                continue
            unique = sorted(set(ranges))
            data = daemon.read_ranges(namespace, step, name, unique)
            parts, at = {}, 0
            for off, length in unique:
                parts[(off, length)] = data[at : at + length]
                at += length
            ranged[name] = parts

        def mapped(name: str) -> torch.Tensor:
            return _arena.map_file(pin.paths[name]).buffer

        where = f"{namespace}/step {step}"
        local = Files(
            where,
            mapped,
            pin.paths,
            ranged,
            records={f.name: f for f in pin.step.files if f.name in pin.paths},
            verify_tensors=self.verify_reads,
        )
        # Needed in bulk and held elsewhere: from the nodes that hold them, into the tensors.
        files = local if remote is None else remote.files(where, whole, local)
        files.fetched = fetched
        try:
            yield files
        finally:
            files.close()
            try:
                daemon.unpin(namespace, step, pin.pin_id)
            except TierCkptError as e:
                logger.warning(
                    "%s/step %d: could not unpin: %s (it expires by itself)", namespace, step, e
                )
