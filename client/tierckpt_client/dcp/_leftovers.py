"""What a failed save leaves on the daemon, given back when its writer is closed or collected.

DCP tells a storage writer nothing when a save fails: after an error on any rank (in a storage
method, the planner or a collective) it raises ``CheckpointException`` and never calls the writer
again. So the writer notes what it holds while a save is under way: the file ``stage`` leased (or
that a plain ``save`` leased while the ranks planned), and, on the coordinator, the save attempt
the ranks sealed their files into. The save clears each note
once it has used the thing (``write_data`` seals the staged file, ``finish`` commits the attempt).
Whatever is still noted when the writer is closed or garbage-collected belongs to a save that
failed, and goes back to the daemon then, rather than when the daemon's ``lease_ttl_s`` runs out
(default 15 minutes): it is memory the next save may need.
"""

from __future__ import annotations

import logging

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp._targets import OutFile
from tierckpt_core.errors import NotFoundError, TierCkptError

logger = logging.getLogger(__name__)


class Leftovers:
    """One writer's notes; :meth:`give_back` must not refer to the writer (it runs as the
    writer's finalizer)."""

    def __init__(self, daemon: DaemonClient) -> None:
        self.daemon = daemon
        self.namespace: str | None = None
        self.staged: OutFile | None = None  # leased by stage(), not yet sealed
        self.reserved: OutFile | None = None  # leased by a plain save as it planned, not yet used
        self.attempt: tuple[int, str] | None = None  # (step, attempt): sealed, not yet committed

    def give_back(self) -> None:
        """Release the staged file and abort the uncommitted attempt, if any; never raises (it
        runs in finalizers and on error paths, where the save's own error is the one to see)."""
        namespace = self.namespace
        leased = [f for f in (self.staged, self.reserved) if f is not None]
        self.staged = self.reserved = None
        attempt, self.attempt = self.attempt, None
        if namespace is None:
            return
        for f in leased:
            if f.lease_id is None:
                continue
            try:
                self.daemon.release(namespace, f.lease_id)
            except TierCkptError as e:  # it expires on the daemon by itself
                logger.warning(
                    "%s: could not release the file leased for a failed save: %s", namespace, e
                )
            finally:
                f.unlock()
        if attempt is not None:
            step, attempt_id = attempt
            try:
                self.daemon.abort(namespace, step, attempt_id)
            except NotFoundError:  # already gone: superseded by a newer attempt, or expired
                return
            except TierCkptError as e:
                logger.warning(
                    "%s/step %d: could not abort the failed save attempt %s: %s",
                    namespace,
                    step,
                    attempt_id,
                    e,
                )
                return
            logger.info(
                "%s/step %d: aborted failed save attempt %s; its memory is free",
                namespace,
                step,
                attempt_id,
            )
