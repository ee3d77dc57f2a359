"""Reading and writing the persistent tier straight from the trainer, for when there is no daemon.

The format is the daemon's (see docs/format.md): a restore never depends on a daemon being up, and
a save made in degraded mode is an ordinary durable step that the daemon can later hydrate.

Writes: every rank uploads one file with all of its items plus a small ``<file>.sum.json`` sidecar
(name, rank, length, checksum); the coordinator reads the sidecars, writes the manifest and then the
commit marker, and removes the sidecars.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from tierckpt_client.errors import CheckpointFormatError, NotFoundError, StepNotFoundError
from tierckpt_client.layout import (
    durable_steps,
    file_key,
    marker_key,
    read_step_manifest,
    step_prefix,
    verify_file,
    write_step_commit,
)
from tierckpt_client.objectstore import ObjectStore, StoreSettings, open_store
from tierckpt_core.manifest import FileRecord, StepManifest

logger = logging.getLogger(__name__)

SIDECAR = ".sum.json"


def _bytes_view(t: torch.Tensor) -> memoryview:
    array: Any = t.numpy()  # a uint8 CPU tensor: no copy
    return memoryview(array).cast("B")


class DirectTier:
    def __init__(self, url: str, settings: StoreSettings | None = None) -> None:
        self.url = url
        self.store: ObjectStore = open_store(url, settings or StoreSettings.from_env())
        self._manifests: dict[tuple[str, int], StepManifest] = {}

    # -- reads ------------------------------------------------------------------------------
    def newest_good_step(self, namespace: str) -> int:
        skipped = []
        for step in reversed(durable_steps(self.store, namespace)):
            try:
                self.manifest(namespace, step)
            except (CheckpointFormatError, NotFoundError) as e:
                logger.warning("%s: skipping step %d for an older one: %s", namespace, step, e)
                skipped.append(f"step {step}: {e}")
                continue
            return step
        raise StepNotFoundError(
            f"namespace {namespace} has no durable step in {self.url}"
            + (f" that could be read ({'; '.join(skipped)})" if skipped else "")
        )

    def manifest(self, namespace: str, step: int) -> StepManifest:
        key = (namespace, step)
        if key not in self._manifests:
            self._manifests[key] = read_step_manifest(self.store, namespace, step)
        return self._manifests[key]

    def fetch(self, namespace: str, step: int, name: str) -> torch.Tensor:
        """Download one file of a durable step, verified, as a uint8 tensor."""
        entry = next((f for f in self.manifest(namespace, step).files if f.name == name), None)
        if entry is None:
            raise CheckpointFormatError(f"{namespace}/step {step}: the manifest has no file {name}")
        buf = torch.empty(entry.length, dtype=torch.uint8)
        got = self.store.get_into(file_key(namespace, step, name), _bytes_view(buf))
        verify_file(got, entry, namespace, step, self.url)
        return buf

    # -- writes -----------------------------------------------------------------------------
    def begin(self, namespace: str, step: int) -> None:
        """Before any rank writes: an old commit marker of this step must not cover new files."""
        self.store.delete([marker_key(namespace, step)])

    def put_rank_file(
        self, namespace: str, step: int, rank: int, name: str, data: torch.Tensor
    ) -> None:
        digest = self.store.put_bytes(file_key(namespace, step, name), _bytes_view(data))
        sidecar = {"name": name, "rank": rank, "length": data.numel(), "checksum": digest}
        self.store.put_bytes(
            file_key(namespace, step, name + SIDECAR), json.dumps(sidecar).encode()
        )

    def commit(
        self,
        namespace: str,
        step: int,
        names: list[str],
        metadata: dict[str, object],
        world_size: int,
        committed_at: float,
    ) -> None:
        files = []
        for name in sorted(names):
            raw = json.loads(self.store.get_bytes(file_key(namespace, step, name + SIDECAR)))
            files.append(
                FileRecord(
                    name=name,
                    rank=int(raw["rank"]),
                    length=int(raw["length"]),
                    checksum=str(raw["checksum"]),
                )
            )
        write_step_commit(
            self.store,
            StepManifest(
                namespace=namespace,
                step=step,
                world_size=world_size,
                committed_at=committed_at,
                files=files,
                metadata=metadata,
            ),
        )
        self.store.delete([file_key(namespace, step, n + SIDECAR) for n in names])
        logger.info(
            "%s/step %d written straight to %s (%s)",
            namespace,
            step,
            self.url,
            step_prefix(namespace, step),
        )
