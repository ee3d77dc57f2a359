"""The persistent tier read back into memory: which steps are durable, a durable step's
manifest, and its files brought into the memory tier (hydration), each verified as it lands.

:class:`~tierckpt_daemon.tier.persist.Persister` inherits these (its reading half; the uploads are
the persister itself): they share its store, its pool and its service.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

from tierckpt_core.errors import (
    IntegrityError,
    NotFoundError,
    PersistentTierError,
    PersistentTierUnavailableError,
    StepNotFoundError,
)
from tierckpt_core.integrity import checksum_file_blocks
from tierckpt_core.layout import (
    durable_steps,
    file_key,
    newest_durable_steps,
    read_step_manifest,
    verify_file,
)
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_core.objectstore import ObjectStore
from tierckpt_core.protocol import StepInfo
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.tier.hydration import fill_step
from tierckpt_daemon.tier.ownership import owned_by
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 10.0  # between INFO lines of a hydration still running


T = TypeVar("T")

LISTERS = 2
_LISTINGS = concurrent.futures.ThreadPoolExecutor(LISTERS, thread_name_prefix="tierckpt-listing")
"""Listings a load waits for only a while (:meth:`DurableReads._listed`): run here, so that one
the load gave up on ends in the background, and a tier that hangs holds at most these threads."""


class DurableReads:
    service: TierService
    store: ObjectStore
    _pool: Executor
    _cv: threading.Condition
    _hydrating: dict[tuple[str, int], list[int]]  # -> [done bytes, total bytes]

    def durable_steps(self, namespace: str, *, wait_s: float | None = None) -> list[int]:
        """Steps with a commit marker in the persistent tier, oldest first."""
        return self._listed(namespace, lambda: durable_steps(self.store, namespace), wait_s)

    def newest_durable_steps(
        self, namespace: str, below: int | None, *, wait_s: float | None = None
    ) -> tuple[list[int], bool]:
        """The newest few steps with a commit marker (older than ``below``), newest first, and
        whether older ones may be there (:func:`tierckpt_core.layout.newest_durable_steps`)."""
        return self._listed(
            namespace, lambda: newest_durable_steps(self.store, namespace, below=below), wait_s
        )

    def _listed(self, namespace: str, listing: Callable[[], T], wait_s: float | None) -> T:
        """``listing()``, whose outcome is the persistent tier's health as ``tierckpt status``
        and ``tierckpt_persistent_healthy`` show it: a failed listing (every "latest" lists the
        tier) marks it unhealthy, so an outage shows while no upload is queued; a listing that
        works marks it healthy again unless an upload is failing. With ``wait_s``, a listing
        that has not answered by then fails (PersistentTierUnavailableError) and goes on in the
        background, bounded by the tier's own timeouts (on at most :data:`LISTERS` threads)."""
        try:
            if wait_s is None:
                result = listing()
            else:
                try:
                    result = _LISTINGS.submit(listing).result(timeout=wait_s)
                except concurrent.futures.TimeoutError:
                    raise PersistentTierUnavailableError(
                        f"{self.store.url} did not answer a listing within {wait_s:g}s"
                    ) from None
        except PersistentTierError as e:
            self.tier_failed(f"listing {namespace} in {self.store.url} failed: {e}")
            raise
        self.tier_answered()
        return result

    def tier_failed(self, message: str) -> None:
        """The persistent tier failed a call (the uploader's health records it)."""

    def tier_answered(self) -> None:
        """The persistent tier answered a call."""

    def manifest(self, namespace: str, step: int) -> StepManifest:
        """The manifest of a durable step, as the persistent tier holds it."""
        return read_step_manifest(self.store, namespace, step)

    def hydrate(
        self, namespace: str, step: int, files: set[str] | None = None, *, owner: str | None = None
    ) -> StepInfo:
        """Bring a durable step into memory (verified), unless it is there already. Of a step
        that spanned nodes only ``files`` come (default: this node's own share). ``owner``: the
        step must be that identity's (StepNotFoundError if its manifest names another). One at a
        time per step: the caller's (:class:`~tierckpt_daemon.tier.restore.Restorer` holds the
        step's single flight around every source)."""
        try:
            rec = self.service.record(namespace, step, owner=owner)
        except NotFoundError:
            return self._hydrate(namespace, step, files, owner)
        if files and not files <= set(rec.files):
            return self._hydrate(namespace, step, files - set(rec.files), owner)
        return rec.info()

    def _hydrate(
        self, namespace: str, step: int, names: set[str] | None, owner: str | None
    ) -> StepInfo:
        t0 = time.monotonic()
        manifest = read_step_manifest(self.store, namespace, step)
        if not owned_by(manifest.owner, owner):
            # Another owner's step of the same name is not this caller's: as if not there (its
            # "latest" goes on to an older step), like another owner's copy on a peer.
            raise StepNotFoundError(
                f"{namespace}/step {step} in {self.store.url} was saved by {manifest.owner}, "
                f"not by {owner}: it is not restored for them"
            )
        spanning = manifest if manifest.coordinator is not None else None
        files = manifest.files
        if spanning is not None:
            if names is None:
                names = {f.name for f in manifest.share(self.service.node or "")}
            files = [f for f in manifest.files if f.name in names]
        progress = [0, sum(f.length for f in files)]
        with self._cv:
            self._hydrating[(namespace, step)] = progress

        said = [time.monotonic()]  # when progress was last logged (a long hydration: minutes)

        def fetch(f: FileRecord, path: str) -> None:
            self._download(namespace, step, f, path)
            with self._cv:
                progress[0] += f.length
                done, now = progress[0], time.monotonic()
                if now - said[0] < PROGRESS_INTERVAL_S:
                    return
                said[0] = now
            logger.info(
                "%s/step %d: hydrating from %s: %.0f of %.0f MiB",
                namespace,
                step,
                self.store.url,
                done / (1 << 20),
                progress[1] / (1 << 20),
                extra=step_fields(namespace, step),
            )

        try:
            # Files download in parallel, like uploads.
            rec = fill_step(
                self.service,
                namespace,
                step,
                files,
                copy_of=manifest,
                fetch=fetch,
                pool=self._pool,
                attempt_prefix="h",
                replicate=False,  # durable already; peers hydrate it themselves when they need it
                spanning=spanning,
                hold=True,  # for a reader: retention must not take it back at once
                owner=manifest.owner,
            )
        finally:
            with self._cv:
                self._hydrating.pop((namespace, step), None)
        self.service.mark_durable(rec, {f.name: f.checksum for f in files if f.checksum})
        nbytes = sum(f.length for f in files)
        self.service.metrics.hydrated_bytes.inc(nbytes)
        dt = time.monotonic() - t0
        logger.info(
            "%s/step %d hydrated from %s: %d bytes in %.2fs (%.0f MB/s), checksums verified",
            namespace,
            step,
            self.store.url,
            nbytes,
            dt,
            nbytes / max(dt, 1e-9) / 1e6,
        )
        return rec.info()

    def _download(self, namespace: str, step: int, f: FileRecord, path: str) -> None:
        key = file_key(namespace, step, f.name)
        if f.length == 0:
            got = self.store.get_into(key, memoryview(bytearray()))
        else:
            # pwrite, not a mapping: the file's pages are fresh (no pre-faulting), and tmpfs
            # allocates them about twice as fast on write() as on a page fault per 4 KiB.
            # O_NONBLOCK: a FIFO put where the leased file was would hold this open forever.
            fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise IntegrityError(
                        f"{namespace}/step {step}: the file leased for {f.name} in memory was "
                        "replaced by something other than a regular file"
                    )
                got = self.store.get_to_file(key, fd, f.length)
            finally:
                os.close(fd)
        try:
            verify_file(got, f, namespace, step, self.store.url)
        except IntegrityError as e:
            self.service.metrics.verification_failures.labels(tier="persistent").inc()
            block = _first_bad_block(path, f)
            if block is None:
                raise
            # The reader's warning names the block, as a reader's own block checks do.
            assert f.block_size
            n = min(f.block_size, f.length - block * f.block_size)
            raise IntegrityError(
                f"{namespace}/step {step}: file {f.name} in {self.store.url} is corrupt: block "
                f"{block} (bytes {block * f.block_size}+{n}) does not match the checksum taken "
                "when it was written"
            ) from e


def _first_bad_block(path: str, f: FileRecord) -> int | None:
    """The first block of a downloaded file that does not match its block checksum (read again
    only after the whole-file checksum failed), or None if it has none or all match."""
    if not (f.blocks and f.block_size and f.length):
        return None
    try:
        _, _, blocks = checksum_file_blocks(path, f.length)
    except OSError:
        return None
    return next((i for i, (a, b) in enumerate(zip(blocks, f.blocks, strict=False)) if a != b), None)
