"""The persistent tier as a save target, straight from the trainer: for when there is no daemon
(see ``targets.base`` for the seam it fills; a load reads it through ``sources.persistent``).

The format is the daemon's (see docs/format.md): a restore never depends on a daemon being up, and
a save made in degraded mode is an ordinary durable step that the daemon can later hydrate.

Writes: every rank uploads its files, each with the sidecar the daemon's uploads write
(``layout.write_sidecar``: name, rank, length, checksum); the coordinator reads the sidecars,
writes the manifest and then the commit marker, and removes the sidecars.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tierckpt_client.dcp.targets.base import OutFile, bytes_view, overwrite_refused, private_file
from tierckpt_core.layout import (
    delete_sidecars,
    file_key,
    marker_key,
    read_sidecar,
    step_prefix,
    write_sidecar,
    write_step_commit,
)
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_core.objectstore import ObjectStore, StoreSettings, open_store
from tierckpt_core.protocol import CommitRequest

logger = logging.getLogger(__name__)


class PersistentTier:
    """A :class:`~tierckpt_client.dcp.targets.base.SaveTarget` on the persistent tier at ``url`` (a
    load reads it through ``sources.persistent``). ``discard`` gives back files a rank had
    staged into its daemon's memory before the save went here (their bytes are uploaded, the
    leases released)."""

    def __init__(
        self,
        url: str,
        settings: StoreSettings | None = None,
        *,
        discard: Callable[[str, OutFile], None] | None = None,
        overwrite: bool = True,
    ) -> None:
        self.url = url
        self.overwrite = overwrite
        self.store: ObjectStore = open_store(url, settings or StoreSettings.from_env())
        self._manifests: dict[tuple[str, int], StepManifest] = {}
        self._discard = discard

    # -- writes -----------------------------------------------------------------------------
    def begin(self, namespace: str, step: int) -> None:
        """Before any rank writes: an old commit marker of this step must not cover new files
        (with ``overwrite=False``, an existing one refuses the save)."""
        if not self.overwrite and self.store.exists(marker_key(namespace, step)):
            raise overwrite_refused(namespace, step)
        self.store.delete([marker_key(namespace, step)])

    def new_file(self, namespace: str, rank: int, name: str, size: int) -> OutFile:
        return private_file(name, size)

    def write(
        self, namespace: str, step: int, attempt: str, rank: int, files: list[OutFile]
    ) -> None:
        for f in files:
            data = f.mapping().buffer[: f.length]
            digest = self.store.put_bytes(file_key(namespace, step, f.name), bytes_view(data))
            record = FileRecord(name=f.name, rank=rank, length=f.length, checksum=digest)
            write_sidecar(self.store, namespace, step, record)
        for f in files:
            if self._discard is not None:
                self._discard(namespace, f)

    def commit(self, namespace: str, step: int, attempt: str, req: CommitRequest) -> None:
        names = sorted(req.files)
        files = [read_sidecar(self.store, namespace, step, name) for name in names]
        write_step_commit(
            self.store,
            StepManifest(
                namespace=namespace,
                step=step,
                world_size=req.world_size,
                committed_at=time.time(),
                files=files,
                metadata=req.metadata,
            ),
        )
        delete_sidecars(self.store, namespace, step, names)
        logger.info(
            "%s/step %d written straight to %s (%s)",
            namespace,
            step,
            self.url,
            step_prefix(namespace, step),
        )
