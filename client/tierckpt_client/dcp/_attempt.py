"""One save on one rank: the files it holds, from the lease to the seal, and what goes back if it fails.

DCP tells a storage writer nothing when a save fails: after an error on any rank (in a storage
method, the planner or a collective) it raises ``CheckpointException`` and never calls the writer
again. So the writer's :class:`SaveFiles` holds every file the save leased until the save hands it
on: the file ``stage`` leased (or that a plain ``save`` leased while the ranks planned), the files
``write_data`` fills for the seal, and, on the coordinator, the save attempt the ranks sealed their
files into until ``finish`` commits it. A failed ``write_data`` or ``finish`` gives back at once
what it held; whatever is still held when the writer is closed or garbage-collected belongs to a
save that failed elsewhere, and goes back to the daemon then, rather than when the daemon's
``lease_ttl_s`` runs out (default 15 minutes): it is memory the next save may need.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp.targets.base import OutFile, SaveTarget
from tierckpt_client.dcp.targets.memory import release_lease
from tierckpt_core.errors import NotFoundError, TierCkptError

logger = logging.getLogger(__name__)


class SaveFiles:
    """The files of one save on this rank, and the attempt they were sealed into.

    Each file is in one place at a time: ``staged`` (leased by ``stage``), ``reserved`` (leased by
    a plain save as it planned), ``kept`` (filled by ``write_data``, to be sealed), or given back.
    :meth:`seal` hands ``kept`` to the target; the coordinator then holds ``sealed`` (step,
    attempt) until :meth:`committed`. :meth:`give_back_soon` must not refer to the writer (it
    runs as the writer's finalizer)."""

    def __init__(self, daemon: DaemonClient) -> None:
        self.daemon = daemon
        self.namespace: str | None = None
        self.staged: OutFile | None = None
        self.reserved: OutFile | None = None
        self.kept: list[OutFile] = []
        self.sealed: tuple[int, str] | None = None

    def hold_staged(self, namespace: str, f: OutFile) -> None:
        self.namespace, self.staged = namespace, f

    def hold_reserved(self, namespace: str, f: OutFile) -> None:
        self.namespace, self.reserved = namespace, f

    def take_reserved(self) -> OutFile | None:
        """The reserved file, for the caller to fill or give back (``_items.pack_extra``)."""
        f, self.reserved = self.reserved, None
        return f

    def keep_staged(self, name: str) -> OutFile:
        """Keep the staged file, to be sealed as ``name``; returns it (to note its segments)."""
        assert self.staged is not None
        f, self.staged = replace(self.staged, name=name), None
        self.kept.append(f)
        return f

    def keep(self, namespace: str, f: OutFile) -> None:
        self.namespace = namespace
        self.kept.append(f)

    def drop(self, namespace: str, f: OutFile) -> None:
        """Give back one leased file the save will not seal (private memory needs nothing)."""
        if f is self.staged:
            self.staged = None
        if f is self.reserved:
            self.reserved = None
        self._release(namespace, f)

    def drop_staged(self) -> None:
        if self.staged is not None and self.namespace is not None:
            self.drop(self.namespace, self.staged)

    def drop_reserved(self) -> None:
        if self.reserved is not None and self.namespace is not None:
            self.drop(self.namespace, self.reserved)

    def seal(
        self, target: SaveTarget, namespace: str, step: int, attempt: str, rank: int, *, note: bool
    ) -> list[OutFile]:
        """Hand the kept files to ``target`` (even none: the rank took part); with ``note``, hold
        the attempt until :meth:`committed`. Returns the files sealed."""
        self.namespace = namespace
        target.write(namespace, step, attempt, rank, self.kept)
        sealed, self.kept = self.kept, []
        if note:
            self.sealed = (step, attempt)
        return sealed

    def committed(self) -> None:
        self.sealed = None

    def hand_over(self, daemon: DaemonClient) -> SaveFiles:
        """The staged file, moved to a new holder (the writer's pickled copy, which writes it)."""
        moved = SaveFiles(daemon)
        moved.namespace, moved.staged, self.staged = self.namespace, self.staged, None
        if moved.staged is not None:
            # A claimed pre-lease: the lock cannot travel; the helper seals the file soon.
            moved.staged.unlock()
        return moved

    def release_unsealed(self) -> None:
        """Give back every file not yet sealed; never raises (the save's own error is the one to
        see)."""
        leased = [f for f in (self.staged, self.reserved, *self.kept) if f is not None]
        self.staged = self.reserved = None
        self.kept = []
        if self.namespace is not None:
            for f in leased:
                self._release(self.namespace, f)

    def give_back_soon(self) -> None:
        """:meth:`give_back` in a thread of its own, if anything is held. The writer's finalizer
        runs wherever the garbage collector happens to find the writer: possibly in the middle of
        a call on this thread's shared daemon connection, whose (non-reentrant) lock a release
        from this thread would then wait for forever."""
        if self.staged is None and self.reserved is None and not self.kept and not self.sealed:
            return
        threading.Thread(target=self.give_back, name="tierckpt-give-back", daemon=True).start()

    def give_back(self) -> None:
        """Release the unsealed files and abort the uncommitted attempt, if any; never raises (it
        runs in finalizers and on error paths)."""
        self.release_unsealed()
        attempt, self.sealed = self.sealed, None
        namespace = self.namespace
        if namespace is None or attempt is None:
            return
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

    def _release(self, namespace: str, f: OutFile) -> None:
        release_lease(self.daemon, namespace, f)
