"""What a daemon serves its peers: its committed steps (a listing, a step's manifest with every
file's checksum, a file's bytes), for a peer that restores a step or pulls a replica of it.

A pulled replica is made by the pulling daemon (``Replicator.pull_from``): an ordinary save attempt
there, filled through ``hydration.fill_step`` and committed with its ``origin``; retention applies
to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

from tierckpt_core.errors import (
    NotFoundError,
    TierCkptError,
)
from tierckpt_core.integrity import checksum_file, open_regular
from tierckpt_core.manifest import LocalState, StepManifest
from tierckpt_core.protocol import (
    PeerStep,
    validate_file_name,
)
from tierckpt_daemon.tier.records import read_manifest
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)


class PeerServer:
    def __init__(self, service: TierService) -> None:
        self.service = service

    # -- serving ----------------------------------------------------------------------------
    def list_steps(self, namespace: str) -> list[PeerStep]:
        return [
            PeerStep(
                step=r.step,
                attempt=r.attempt,
                bytes=r.bytes,
                origin=r.origin,
                committed_at=r.committed_at,
                held=None if r.holds_all() else sorted(r.files),
                owner=r.owner,
            )
            for r in self.service.records(namespace)
        ]

    def manifest(self, namespace: str, step: int, *, metadata: bool = True) -> StepManifest:
        """A step's record as this daemon keeps it; ``metadata=False``: without the DCP metadata
        (a peer that wants a share's records or the share table, not the metadata)."""
        rec = self.service.record(namespace, step)
        dcp = read_manifest(rec.manifest_path()).metadata if metadata else ""
        missing = [f for f in rec.files.values() if not f.checksum]
        if missing:
            # Neither replicated nor durable yet: checksum the files now (memory bandwidth).
            pin = self.service.pin(namespace, step, rec.attempt)
            try:
                sums = {f.name: checksum_file(pin.paths[f.name], f.length) for f in missing}
            finally:
                self.service.unpin(namespace, step, pin.pin_id)
            self.service.set_checksums(rec, sums)
        manifest = rec.manifest(dcp).portable()
        if rec.spans_nodes:  # say which of the step's files this daemon can serve
            manifest.local = LocalState(held=sorted(rec.files))
        return manifest

    def open_file(self, namespace: str, step: int, attempt: str, name: str) -> OpenFile:
        """One file of a committed step, open for reading (never through a link); the step is
        pinned until :meth:`OpenFile.close` (or the pin expires)."""
        validate_file_name(name)
        pin = self.service.pin(namespace, step, attempt)
        try:
            rec = self.service.record(namespace, step)
            f = rec.files.get(name)
            if f is None or name not in pin.paths:
                raise NotFoundError(f"{namespace}/step {step} has no file {name}")
            fd = open_regular(pin.paths[name])
        except BaseException:
            self.service.unpin(namespace, step, pin.pin_id)
            raise

        def close() -> None:
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(TierCkptError):
                self.service.unpin(namespace, step, pin.pin_id)

        return OpenFile(fd, f.length, close)


class OpenFile:
    """A served file: its descriptor, its length in the step, and ``close`` (once: closes the
    descriptor and unpins the step)."""

    def __init__(self, fd: int, length: int, close: Callable[[], None]) -> None:
        self.fd, self.length = fd, length
        self._close: Callable[[], None] | None = close

    def close(self) -> None:
        close, self._close = self._close, None
        if close is not None:
            close()
