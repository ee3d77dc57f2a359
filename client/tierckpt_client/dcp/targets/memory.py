"""This node's memory tier as a save target, through its daemon: leased tmpfs files, sealed into
a save attempt and committed by the coordinator (a load reads it through ``sources.memory``)."""

from __future__ import annotations

import functools
import logging

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp._helpers import CHECKSUM, on_helpers
from tierckpt_client.dcp.targets.base import OutFile, bytes_view, overwrite_refused
from tierckpt_core.errors import NotFoundError, TierCkptError
from tierckpt_core.integrity import checksum_beside
from tierckpt_core.protocol import CommitRequest, SealFile

logger = logging.getLogger(__name__)


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
            # Below step + 1: the step itself first if any tier holds it (of the persistent
            # tier only the newest durable steps below that are looked up, not every object).
            candidates = self.daemon.candidates_read(namespace, step + 1).candidates
        except NotFoundError:  # the namespace's first save, or no step up to this one
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
            whole, size, blocks = checksum_beside(
                bytes_view(f.mapping().buffer[: f.length]),
                spawn=functools.partial(on_helpers, CHECKSUM),  # woken off this thread's core
            )
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
        release_lease(self.daemon, namespace, f)


def release_lease(daemon: DaemonClient, namespace: str, f: OutFile) -> None:
    """Give back leased file ``f`` (if it is one); never raises: the lease expires on the daemon
    by itself, and the save's own error is the one to see. A lease the daemon no longer has
    (it restarted, or took it back) is what was wanted: said at INFO, not as a warning."""
    if f.lease_id is None:
        return
    try:
        daemon.release(namespace, f.lease_id)
    except NotFoundError as e:
        logger.info("%s: lease %s was already given back: %s", namespace, f.lease_id, e)
    except TierCkptError as e:
        logger.warning("%s: could not release lease %s: %s", namespace, f.lease_id, e)
    finally:
        f.unlock()
