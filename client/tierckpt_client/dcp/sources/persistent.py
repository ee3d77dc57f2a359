"""The persistent tier, read from this process: a durable step that is in no node's memory, or
any step when there is no daemon (see docs/design.md, "Restore straight from the persistent tier").

Streamed (``streamed=True``): a durable step goes from the S3 responses straight into the
destination tensors, verified block by block as it lands (``streamed.StreamedFiles``), and the
daemon then brings it into this node's memory in the background, so that the next restore is
local. Without it, the daemon would download the step into fresh tmpfs pages (a page allocation and
fault per 4 KiB) and the reader copy it from there: two passes over memory, one into cold pages.

Without a daemon (``streamed=False``): each file the reader needs is downloaded whole and verified
(the format is the daemon's, see docs/format.md: a restore never depends on a daemon being up).
Files without block checksums (saved straight here by a writer in degraded mode) are always read
that way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_client.dcp.sources.base import MemoryFill, StepFiles
from tierckpt_client.dcp.sources.files import LocalFiles
from tierckpt_client.dcp.sources.streamed import CONCURRENCY, StreamedFiles
from tierckpt_client.dcp.targets.base import bytes_view
from tierckpt_core.errors import CheckpointFormatError, NotFoundError, StepNotFoundError
from tierckpt_core.layout import file_key, newest_durable_steps, read_step_manifest, verify_file
from tierckpt_core.manifest import StepManifest
from tierckpt_core.objectstore import ObjectStore, StoreSettings, open_store

logger = logging.getLogger(__name__)


class PersistentSource(MemoryFill):
    """A :class:`~tierckpt_client.dcp.sources.base.Source` on the persistent tier at ``url``:
    streamed into the tensors and then filled into this node's memory (``streamed``), or
    downloaded whole (no daemon)."""

    def __init__(
        self,
        url: str,
        config: ClientConfig,
        *,
        streamed: bool,
        settings: StoreSettings | None = None,
        concurrency: int = CONCURRENCY,
    ) -> None:
        super().__init__(config)
        self.url = url
        self.streamed = streamed
        self.concurrency = concurrency
        self.store: ObjectStore = open_store(url, settings or StoreSettings.from_env())
        self._manifests: dict[tuple[str, int], StepManifest] = {}

    def newest_good_step(self, namespace: str, below: int | None = None) -> int:
        """The newest durable step (older than ``below``) whose manifest reads; older ones are
        tried when a newer one is corrupt or incomplete, with a warning naming the step."""
        skipped = []
        ask, more = below, True
        while more:  # a few at a time, newest first: not the listing of every object
            steps, more = newest_durable_steps(self.store, namespace, below=ask)
            for step in steps:
                try:
                    self.manifest(namespace, step)
                except (CheckpointFormatError, NotFoundError) as e:
                    logger.warning("%s: skipping step %d for an older one: %s", namespace, step, e)
                    skipped.append(f"step {step}: {e}")
                    continue
                return step
            if steps:
                ask = steps[-1]
        raise StepNotFoundError(
            f"namespace {namespace} has no durable step"
            + (f" older than step {below}" if below is not None else "")
            + f" in {self.url}"
            + (f" that could be read ({'; '.join(skipped)})" if skipped else "")
        )

    def manifest(self, namespace: str, step: int) -> StepManifest:
        key = (namespace, step)
        if key not in self._manifests:
            self._manifests[key] = read_step_manifest(self.store, namespace, step)
        return self._manifests[key]

    def metadata(self, namespace: str, step: int) -> str:
        return self.manifest(namespace, step).metadata

    def fetch(self, namespace: str, step: int, name: str) -> torch.Tensor:
        """Download one file of a durable step, verified, as a uint8 tensor."""
        entry = next((f for f in self.manifest(namespace, step).files if f.name == name), None)
        if entry is None:
            raise CheckpointFormatError(f"{namespace}/step {step}: the manifest has no file {name}")
        buf = torch.empty(entry.length, dtype=torch.uint8)
        got = self.store.get_into(file_key(namespace, step, name), bytes_view(buf))
        verify_file(got, entry, namespace, step, self.url)
        return buf

    @contextlib.contextmanager
    def open_files(self, namespace: str, step: int, refs: list[ShardRef]) -> Iterator[StepFiles]:
        if not self.streamed:  # files downloaded whole and verified as the reader needs each
            yield LocalFiles(
                f"{namespace}/step {step}", lambda n: self.fetch(namespace, step, n), {}
            )
            return
        manifest = self.manifest(namespace, step)
        where = f"{namespace}/step {step} in {self.url}"
        whole = LocalFiles(where, lambda name: self.fetch(namespace, step, name), {})
        files = StreamedFiles(
            where,
            self.store,
            {f.name: file_key(namespace, step, f.name) for f in manifest.files},
            {f.name: f for f in manifest.files},
            whole,
            concurrency=self.concurrency,
        )
        try:
            yield files
        finally:
            files.close()
        self.fill_memory(namespace, step)
