"""The persistent tier: upload committed steps in the background, hydrate steps back into memory.

Uploads run in the daemon, never in the trainer. One worker takes committed steps in commit order;
each step's files upload in parallel (``TIERCKPT_UPLOAD_CONCURRENCY``), each file's checksum is
computed while it streams, then ``manifest.json`` (files, lengths, checksums, DCP metadata) and last
the ``COMMITTED`` marker. Only then is the step DURABLE, and only then may it leave memory. A failed
upload is retried with backoff; the memory tier keeps working meanwhile, and the error shows in the
daemon's status. After a restart, committed steps still marked ``persist_pending`` are queued again.

Hydration downloads a durable step's files into the arena, verifies every checksum, and registers
the step as committed and durable, so readers use it like any step in memory.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections import deque

from tierckpt_core.errors import IntegrityError, NotFoundError, TierCkptError
from tierckpt_core.layout import (
    MARKER,
    StepManifest,
    StoredFile,
    durable_steps,
    file_key,
    marker_key,
    parse_step_key,
    read_step_manifest,
    step_prefix,
    verify_file,
    write_step_commit,
)
from tierckpt_core.objectstore import ObjectStore
from tierckpt_core.protocol import (
    HydrationProgress,
    PersistentStatus,
    StepInfo,
)
from tierckpt_daemon.background import background_pool, lower_priority
from tierckpt_daemon.hydration import fill_step
from tierckpt_daemon.index import FileRecord, StepRecord, read_manifest
from tierckpt_daemon.service import TierService

logger = logging.getLogger(__name__)

RETRY_BASE_S = 2.0
RETRY_MAX_S = 120.0


class Persister:
    def __init__(
        self,
        service: TierService,
        store: ObjectStore,
        *,
        concurrency: int = 4,
        keep_last: int = 0,
        nice: int = 0,
    ) -> None:
        self.service = service
        self.store = store
        self.keep_last = keep_last
        self.nice = nice
        self._pool = background_pool(concurrency, "tierckpt-upload", nice)
        self._queue: deque[StepRecord] = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._stop = False
        self._healthy: bool | None = None
        self._last_error: str | None = None
        self._uploaded_bytes = 0
        self._uploaded_steps = 0
        self._failed = 0
        self._hydrate_locks: dict[tuple[str, int], threading.Lock] = {}
        self._hydrate_guard = threading.Lock()
        self._hydrating: dict[tuple[str, int], list[int]] = {}  # -> [done bytes, total bytes]
        self._uploading: dict[tuple[str, int], list[int]] = {}  # -> [done bytes, total bytes]
        self._thread = threading.Thread(target=self._run, name="tierckpt-persister", daemon=True)

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        for rec in self.service.pending_uploads():
            logger.info("%s/step %d: resuming its upload", rec.namespace, rec.step)
            self._queue.append(rec)
        self._thread.start()

    def enqueue(self, rec: StepRecord) -> None:
        with self._cv:
            self._queue.append(rec)
            self._cv.notify_all()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued upload finished (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.5))
        return True

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def status(self) -> PersistentStatus:
        with self._cv:
            return PersistentStatus(
                url=self.store.url,
                healthy=self._healthy,
                last_error=self._last_error,
                queued_steps=len(self._queue) + (1 if self._busy else 0),
                uploaded_bytes=self._uploaded_bytes,
                uploaded_steps=self._uploaded_steps,
                failed_uploads=self._failed,
                hydrations=[
                    HydrationProgress(namespace=ns, step=st, done_bytes=p[0], total_bytes=p[1])
                    for (ns, st), p in sorted(self._hydrating.items())
                ],
                uploads=[
                    HydrationProgress(namespace=ns, step=st, done_bytes=p[0], total_bytes=p[1])
                    for (ns, st), p in sorted(self._uploading.items())
                ],
            )

    def check_health(self) -> None:
        try:
            self.store.health()
        except TierCkptError as e:
            self._record_error(f"persistent tier {self.store.url} is unusable: {e}")
        else:
            with self._cv:
                self._healthy = True

    def _record_error(self, message: str) -> None:
        logger.error("%s", message)
        with self._cv:
            self._healthy = False
            self._last_error = message

    # -- uploads ----------------------------------------------------------------------------
    def _run(self) -> None:
        lower_priority(self.nice)
        self.check_health()
        delay = RETRY_BASE_S
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                rec = self._queue[0]
                self._busy = True
            try:
                self._upload(rec)
            except (TierCkptError, OSError) as e:
                with self._cv:
                    self._failed += 1
                self.service.metrics.upload_failures.inc()
                self._record_error(
                    f"{rec.namespace}/step {rec.step}: upload to {self.store.url} failed: {e}; "
                    f"retrying in {delay:.0f}s (the step stays in memory)"
                )
                with self._cv:
                    self._busy = False
                    self._cv.wait(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            delay = RETRY_BASE_S
            with self._cv:
                self._queue.popleft()
                self._busy = False
                self._cv.notify_all()

    def _upload(self, rec: StepRecord) -> None:
        ns, step = rec.namespace, rec.step
        if not self.service.is_current(rec):
            self.service.cancel_persist(rec)
            return
        t0 = time.monotonic()
        doc = read_manifest(rec.manifest_path())
        # A re-upload of the step (a newer attempt) must never leave an old marker over new files.
        self.store.delete([marker_key(ns, step)])
        files = sorted(rec.files.values(), key=lambda f: f.name)
        # Progress for `tierckpt persist --wait`, in bytes of the files finished so far.
        progress = [0, sum(f.length for f in files)]
        with self._cv:
            self._uploading[(ns, step)] = progress

        def upload(f: FileRecord) -> str:
            digest = self.store.put_file(
                file_key(ns, step, f.name), str(rec.dir / f.name), f.length
            )
            with self._cv:
                progress[0] += f.length
            return digest

        futures = {f.name: self._pool.submit(upload, f) for f in files}
        # Let every upload end before raising: a retry must not race a still-running one.
        try:
            concurrent.futures.wait(futures.values())
        finally:
            with self._cv:
                self._uploading.pop((ns, step), None)
        checksums = {name: fut.result() for name, fut in futures.items()}
        manifest = StepManifest(
            namespace=ns,
            step=step,
            world_size=rec.world_size,
            committed_at=rec.committed_at,
            files=tuple(StoredFile(f.name, f.rank, f.length, checksums[f.name]) for f in files),
            metadata=doc["metadata"],
        )
        write_step_commit(self.store, manifest)
        self.service.mark_durable(rec, checksums)
        nbytes = sum(f.length for f in files)
        m = self.service.metrics
        m.uploaded_bytes.inc(nbytes)
        m.uploaded_steps.inc()
        m.upload_seconds.observe(time.monotonic() - t0)
        with self._cv:
            self._uploaded_bytes += nbytes
            self._uploaded_steps += 1
            self._healthy = True
            self._last_error = None
        dt = time.monotonic() - t0
        logger.info(
            "%s/step %d durable in %s: %d files, %d bytes in %.2fs (%.0f MB/s)",
            ns,
            step,
            self.store.url,
            len(files),
            nbytes,
            dt,
            nbytes / max(dt, 1e-9) / 1e6,
        )
        self._apply_retention(ns)

    def _apply_retention(self, namespace: str) -> None:
        if self.keep_last <= 0:
            return
        steps = self.durable_steps(namespace)
        doomed = steps[: -self.keep_last]  # never the newest durable step
        for step in doomed:
            keys = [o.key for o in self.store.list(step_prefix(namespace, step))]
            # The marker goes first: from then on the step is simply incomplete.
            self.store.delete([marker_key(namespace, step)])
            self.store.delete([k for k in keys if not k.endswith("/" + MARKER)])
            logger.info(
                "%s/step %d removed from %s (keep last %d)",
                namespace,
                step,
                self.store.url,
                self.keep_last,
            )
        if steps:
            self._collect_incomplete(namespace, below=steps[-1])

    def _collect_incomplete(self, namespace: str, below: int) -> None:
        """Delete leftovers of uploads that never finished, older than the newest durable step."""
        by_step: dict[int, list[str]] = {}
        for obj in self.store.list(f"{namespace}/"):
            parsed = parse_step_key(namespace, obj.key)
            if parsed is not None:
                by_step.setdefault(parsed[0], []).append(obj.key)
        for step, keys in by_step.items():
            if step < below and not any(k.endswith("/" + MARKER) for k in keys):
                self.store.delete(keys)
                logger.info(
                    "%s/step %d: removed an incomplete upload from %s",
                    namespace,
                    step,
                    self.store.url,
                )

    # -- reads ------------------------------------------------------------------------------
    def durable_steps(self, namespace: str) -> list[int]:
        """Steps with a commit marker in the persistent tier, oldest first."""
        return durable_steps(self.store, namespace)

    def hydrate(self, namespace: str, step: int) -> StepInfo:
        """Bring a durable step into memory (verified), unless it is there already."""
        with self._hydrate_guard:
            lock = self._hydrate_locks.setdefault((namespace, step), threading.Lock())
        with lock:
            try:
                return self.service.get_step(namespace, step)
            except NotFoundError:
                pass
            return self._hydrate(namespace, step)

    def _hydrate(self, namespace: str, step: int) -> StepInfo:
        t0 = time.monotonic()
        manifest = read_step_manifest(self.store, namespace, step)
        progress = [0, sum(f.length for f in manifest.files)]
        with self._cv:
            self._hydrating[(namespace, step)] = progress

        def fetch(f: StoredFile, path: str) -> None:
            self._download(namespace, step, f, path)
            with self._cv:
                progress[0] += f.length

        try:
            # Files download in parallel, like uploads.
            rec = fill_step(
                self.service,
                namespace,
                step,
                manifest.files,
                metadata=manifest.metadata,
                world_size=manifest.world_size,
                fetch=fetch,
                pool=self._pool,
                attempt_prefix="h",
                replicate=False,  # durable already; peers hydrate it themselves when they need it
            )
        finally:
            with self._cv:
                self._hydrating.pop((namespace, step), None)
        self.service.mark_durable(rec, {f.name: f.checksum for f in manifest.files})
        nbytes = sum(f.length for f in manifest.files)
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

    def _download(self, namespace: str, step: int, f: StoredFile, path: str) -> None:
        key = file_key(namespace, step, f.name)
        if f.length == 0:
            got = self.store.get_into(key, memoryview(bytearray()))
        else:
            # pwrite, not a mapping: the file's pages are fresh (no pre-faulting), and tmpfs
            # allocates them about twice as fast on write() as on a page fault per 4 KiB.
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                got = self.store.get_to_file(key, fd, f.length)
            finally:
                os.close(fd)
        try:
            verify_file(got, f, namespace, step, self.store.url)
        except IntegrityError:
            self.service.metrics.verification_failures.inc()
            raise
