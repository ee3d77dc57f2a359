"""The persistent tier: upload committed steps in the background, hydrate steps back into memory.

Uploads run in the daemon, never in the trainer. One worker takes committed steps in commit order;
each step's files upload in parallel (``TIERCKPT_UPLOAD_CONCURRENCY``), each file's checksum is
computed while it streams, then ``manifest.json`` (files, lengths, checksums, DCP metadata) and last
the ``COMMITTED`` marker. Only then is the step DURABLE, and only then may it leave memory. A failed
upload is retried with backoff while the steps behind it go ahead; the memory tier keeps working
meanwhile, and the error shows in the daemon's status. After a restart, committed steps still marked ``persist_pending`` are queued again.

Hydration downloads a durable step's files into the arena, verifies every checksum, and registers
the step as committed and durable, so readers use it like any step in memory.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

from tierckpt_core.errors import (
    IntegrityError,
    NotFoundError,
    PersistentTierError,
    TierCkptError,
)
from tierckpt_core.layout import (
    MARKER,
    SIDECAR,
    delete_sidecars,
    file_key,
    marker_key,
    parse_step_key,
    read_sidecar,
    step_prefix,
    write_sidecar,
    write_step_commit,
)
from tierckpt_core.manifest import FileRecord, share_digest
from tierckpt_core.objectstore import ObjectStore
from tierckpt_core.protocol import (
    HydrationProgress,
    PersistentStatus,
    StepState,
)
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.tier.background import QueueWorker, background_pool
from tierckpt_daemon.tier.durable_reads import DurableReads
from tierckpt_daemon.tier.records import StepRecord, read_manifest
from tierckpt_daemon.tier.service import TierService
from tierckpt_daemon.tier.share_durable import learn_durable, newest_waiting

logger = logging.getLogger(__name__)

RETRY_BASE_S = 2.0


class _SharesMissing(TierCkptError):
    """The decider of a step spanning nodes waits for other nodes' shares in the tier."""


RETRY_MAX_S = 60.0
SHARES_POLL_S = 2.0  # the decider looks for the other nodes' shares this often at first,
SHARES_POLL_MAX_S = 10.0  # then less and less often, down to this: a look costs a read per node


class Persister(QueueWorker[StepRecord], DurableReads):
    """Uploads committed steps (a commit listener of the service) and hydrates durable ones."""

    def __init__(
        self,
        service: TierService,
        store: ObjectStore,
        *,
        concurrency: int = 4,
        keep_last: int = 0,
        nice: int = 0,
    ) -> None:
        super().__init__(
            "tierckpt-persister", nice=nice, retry_base_s=RETRY_BASE_S, retry_max_s=RETRY_MAX_S
        )
        self.service = service
        self.store = store
        self.keep_last = keep_last
        self._pool = background_pool(concurrency, "tierckpt-upload", nice)
        self._healthy: bool | None = None
        self._last_error: str | None = None
        self._uploaded_since_error = False  # an upload succeeded after the last error
        self._hydrating: dict[tuple[str, int], list[int]] = {}  # -> [done bytes, total bytes]
        self._uploading: dict[tuple[str, int], list[int]] = {}  # -> [done bytes, total bytes]
        # (namespace, step, attempt) -> the decider's own share as uploaded, and its checksums,
        # while it waits for the other nodes' shares; and how long until it looks again.
        self._own_shares: dict[tuple[str, int, str], tuple[list[FileRecord], dict[str, str]]] = {}
        self._share_polls: dict[tuple[str, int, str], float] = {}
        self._waiting: dict[tuple[str, int], str] = {}  # a step -> the shares it waits for

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        for rec in self.service.pending_uploads():
            logger.info("%s/step %d: resuming its upload", rec.namespace, rec.step)
            self.enqueue(rec)
        super().start()

    def committed(self, rec: StepRecord) -> None:
        """Commit listener: queue the step if it is to be persisted."""
        if rec.persist_pending:
            self.enqueue(rec)

    def persist_requested(self, rec: StepRecord) -> None:
        self.enqueue(rec)

    def retired(self, rec: StepRecord) -> None:
        if rec.persist_pending:
            self.hurry(rec)  # skipped (said, counted), then its files leave memory

    def learn_durable(self, namespace: str, step: int, owner: str | None) -> None:
        """A participant's share uploaded: whether the decider made the step durable since."""
        learn_durable(self.service, self.store, namespace, step, owner)

    def watch_markers(self) -> None:
        """Each namespace's newest share uploaded here: whether its step is durable yet (run
        beside every housekeeping sweep; an unexpected error is logged, and the next sweep's
        run tries again)."""
        try:
            for namespace, step, owner in newest_waiting(self.service):
                learn_durable(self.service, self.store, namespace, step, owner)
        except Exception:  # on a task nobody awaits: said here, or never
            logger.exception("reading the markers of steps whose share this node uploaded failed")

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued upload finished (True) or ``timeout_s`` passed (False)."""
        return self.wait_idle(timeout_s, retries=True)

    def stop(self) -> None:
        super().stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def status(self) -> PersistentStatus:
        m = self.service.metrics
        # The failure count before the health (_process marks unhealthy, then counts): a status
        # that shows a failure also shows the tier unhealthy, unless a health check passed since.
        failed = m.total(m.upload_failures)
        with self._cv:
            healthy, last_error = self._healthy, self._last_error
            waiting = [self._waiting[k] for k in sorted(self._waiting)]
            hydrations, uploads = (
                [
                    HydrationProgress(namespace=ns, step=st, done_bytes=p[0], total_bytes=p[1])
                    for (ns, st), p in sorted(table.items())
                ]
                for table in (self._hydrating, self._uploading)
            )
        return PersistentStatus(
            url=self.store.url,
            healthy=healthy,
            last_error=last_error,
            queued_steps=self.queued(),
            uploaded_bytes=m.total(m.uploaded_bytes),
            uploaded_steps=m.total(m.uploaded_steps),
            failed_uploads=failed,
            skipped_uploads=m.total(m.upload_skips),
            hydrations=hydrations,
            uploads=uploads,
            waiting=waiting,
        )

    def check_health(self) -> None:
        try:
            self.store.health()
        except TierCkptError as e:
            self._record_error(f"persistent tier {self.store.url} is unusable: {e}")
        else:
            with self._cv:
                self._healthy = True

    def tier_failed(self, message: str) -> None:
        self._record_error(message)

    def tier_answered(self) -> None:
        if not self.failing():  # an upload that keeps failing stays what status shows
            with self._cv:
                self._healthy = True

    def _record_error(self, message: str, rec: StepRecord | None = None) -> None:
        fields = step_fields(rec.namespace, rec.step, rec.attempt) if rec is not None else {}
        logger.error("%s", message, extra=fields)
        with self._cv:
            self._healthy = False
            self._last_error = message
            self._uploaded_since_error = False

    def _died(self, error: BaseException) -> None:
        self._record_error(
            f"the uploader thread ({self.name}) died of {type(error).__name__}: {error}; no step "
            "is uploaded until the daemon restarts (the memory tier keeps serving; see the log)"
        )

    # -- uploads ----------------------------------------------------------------------------
    def _run(self) -> None:
        self.check_health()
        super()._run()

    def _process(self, rec: StepRecord) -> bool | float:
        rec.uploading = True  # (a flag retention reads under the service's lock: set before)
        key = (rec.namespace, rec.step, rec.attempt)
        waiting: str | None = None
        try:
            self._upload(rec)
        except _SharesMissing as e:  # not a failure: the other nodes are still uploading
            waiting = str(e)
            wait = min(self._share_polls.get(key, SHARES_POLL_S / 2) * 2, SHARES_POLL_MAX_S)
            self._share_polls[key] = wait
            logger.info("%s; looking again in %.0fs", e, wait)
            return wait
        except (TierCkptError, OSError) as e:
            # Unhealthy first, then counted: a status that shows the failure shows it unhealthy.
            self._record_error(
                f"{rec.namespace}/step {rec.step}: upload to {self.store.url} failed: {e}; "
                f"retrying in {self.retry_delay(rec):.0f}s (the step stays in memory)",
                rec,
            )
            self.service.metrics.upload_failures.inc()
            return False
        finally:
            rec.uploading = False
            with self._cv:  # what `tierckpt persist --wait` says the step waits for
                if waiting is None:
                    self._waiting.pop(key[:2], None)
                else:
                    self._waiting[key[:2]] = waiting
            self.service.upload_ended(rec)
        self._share_polls.pop(key, None)
        self._own_shares.pop(key, None)
        return True

    def _skip(self, rec: StepRecord) -> None:
        """A queued step left memory before its upload started: say so, count it, let it go."""
        reason = "superseded" if self.service.has_step(rec.namespace, rec.step) else "retired"
        why = {
            "superseded": "a newer save of the same step replaced it (that one is uploaded)",
            "retired": "it left memory first: retention keeps only the newest "
            f"{self.service.keep_last} steps of the namespace (TIERCKPT_KEEP_LAST), and uploads "
            "did not keep up with the saves; or it was deleted. Newer steps are uploaded",
        }[reason]
        logger.warning(
            "%s/step %d is not uploaded: %s",
            rec.namespace,
            rec.step,
            why,
            extra=step_fields(rec.namespace, rec.step, rec.attempt),
        )
        self.service.metrics.upload_skips.labels(reason=reason).inc()
        with self._cv:
            # Its failure was what kept the status unhealthy, and the tier took an upload since
            # (the outage is over): healthy again, not until some later upload (hours away with
            # a sparse TIERCKPT_PERSIST_EVERY, the alert firing all along).
            if self._uploaded_since_error and not self.failing(besides=rec):
                self._healthy = True
                self._last_error = None
        self.service.cancel_persist(rec)

    def _upload(self, rec: StepRecord) -> None:
        ns, step = rec.namespace, rec.step
        if not self.service.is_current(rec):
            self._skip(rec)
            return
        t0 = time.monotonic()
        metadata = read_manifest(rec.manifest_path()).metadata
        deciding = not rec.spans_nodes or rec.coordinator == self.service.node
        key = (ns, step, rec.attempt)
        # The decider's own share, uploaded at an earlier look while other shares were missing:
        # never uploaded again for each look (gigabytes, every few seconds of a long wait).
        earlier = self._own_shares.get(key)
        if earlier is None:
            uploaded, checksums = self._upload_own(rec, deciding)
        else:
            uploaded, checksums = earlier
        nbytes = sum(f.length for f in uploaded)
        if rec.spans_nodes:
            if not deciding:
                # The decider writes the manifest and the marker once every share is there.
                self.service.share_persisted(rec)
                self._uploaded(rec, nbytes, t0, f"its share of {len(uploaded)} files")
                return
            self._own_shares[key] = (uploaded, checksums)
            everyone = self._collect_shares(rec, uploaded)
            if earlier is not None and not self._still_there(ns, step, uploaded):
                # Removed meanwhile (another step's retention took it for an incomplete
                # upload): sent again (the same bytes, checked against the same checksums, so
                # the shares collected stand), never a marker over files that are not there.
                logger.info("%s/step %d: this node's share is gone from the tier: again", ns, step)
                if self._upload_own(rec, deciding)[1] != checksums:
                    raise IntegrityError(
                        f"{ns}/step {step}: this node's share changed in memory since its first "
                        "upload; not persisting it"
                    )
            uploaded = everyone
        manifest = rec.manifest(metadata).model_copy(
            update={"files": uploaded, "coordinator": rec.coordinator}
        )
        write_step_commit(self.store, manifest)
        self._own_shares.pop(key, None)
        if rec.spans_nodes:
            delete_sidecars(self.store, ns, step, [f.name for f in uploaded])
        self.service.mark_durable(rec, checksums, uploaded=True)
        self._uploaded(rec, nbytes, t0, f"{len(uploaded)} files")
        self._apply_retention(ns)

    def _still_there(self, namespace: str, step: int, files: list[FileRecord]) -> bool:
        """Whether every file of ``files`` (with its sidecar) is in the tier's step directory."""
        keys = {o.key for o in self.store.list(step_prefix(namespace, step))}
        return all(
            file_key(namespace, step, f.name) in keys
            and file_key(namespace, step, f.name + SIDECAR) in keys
            for f in files
        )

    def _upload_own(
        self, rec: StepRecord, deciding: bool
    ) -> tuple[list[FileRecord], dict[str, str]]:
        """Upload the files of ``rec`` this node holds (of a step spanning nodes: its share,
        with a sidecar each), checked against their commit-time checksums; their records as
        uploaded, and the checksums."""
        ns, step = rec.namespace, rec.step
        if deciding:
            # A re-upload (a newer attempt) must never leave an old marker over new files.
            try:
                self.store.delete([marker_key(ns, step)])
            except PersistentTierError as e:  # the first call of an upload: say why it is made
                text = str(e)
                # A policy's refusal, not credentials that S3 refuses (those fail every call).
                bad_keys = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken")
                denied = "accessdenied" in text.lower().replace(" ", "") and not any(
                    k in text for k in bad_keys
                )
                needs = ": the S3 policy must allow s3:DeleteObject" if denied else ""
                e.message = (
                    f"{text} (the upload's first call, removing any earlier {MARKER} marker "
                    f"of the step{needs})"
                )
                e.args = (e.message,)
                raise
        # Of a step spanning nodes, each node uploads the share its own ranks wrote.
        files = [
            f for f in rec.sorted_files() if not rec.spans_nodes or f.node == self.service.node
        ]
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
        for f in files:
            if f.checksum is not None and checksums[f.name] != f.checksum:
                raise IntegrityError(
                    f"{ns}/step {step}: file {f.name} changed in memory since it was committed "
                    f"(checksum {checksums[f.name]}, committed as {f.checksum}); not persisting it"
                )
        uploaded = [f.model_copy(update={"checksum": checksums[f.name]}) for f in files]
        if rec.spans_nodes:
            for f in uploaded:
                write_sidecar(self.store, ns, step, f)
        return uploaded, checksums

    def _collect_shares(self, rec: StepRecord, own: list[FileRecord]) -> list[FileRecord]:
        """The decider of a step spanning nodes: every other node's uploaded share, checked
        against the step's global record (each share's sidecars against its digest).
        _SharesMissing while some are not there yet."""
        ns, step = rec.namespace, rec.step
        files = {f.name: f for f in own}
        waiting: dict[str, list[str]] = {}
        # The decider keeps the step's share table (it is the first of its holders).
        shares = rec.ring.table if rec.ring is not None else {}
        for node, share in sorted(shares.items()):
            names = [n for n in share.names if n not in files]
            if not names:
                continue
            got: list[FileRecord] = []
            for name in names:
                try:
                    got.append(read_sidecar(self.store, ns, step, name))
                except NotFoundError:
                    waiting.setdefault(node, []).append(name)
            if node in waiting:
                continue
            # The uploaders' records carry the block checksums the global record leaves with
            # the files: the persistent manifest has them all, checked against the share's digest.
            theirs = [f for f in files.values() if f.name in share.names] + got
            if share_digest(theirs) != share.digest:
                raise IntegrityError(
                    f"{ns}/step {step}: the files of {node}'s share uploaded ({', '.join(names[:8])}) "
                    "do not match the step's record of that share (length, checksum or block "
                    "checksums differ)"
                )
            files.update({f.name: f.model_copy(update={"node": node, "size": None}) for f in got})
        if waiting:
            raise _SharesMissing(
                f"{ns}/step {step}: waiting for the shares of "
                + ", ".join(
                    f"{node} ({len(names)} files)" for node, names in sorted(waiting.items())
                )
            )
        return sorted(files.values(), key=lambda f: f.name)

    def _uploaded(self, rec: StepRecord, nbytes: int, t0: float, what: str) -> None:
        m = self.service.metrics
        m.uploaded_bytes.inc(nbytes)
        m.uploaded_steps.inc()
        m.upload_seconds.observe(time.monotonic() - t0)
        with self._cv:
            self._uploaded_since_error = True
            if not self.failing(besides=rec):  # else an older step's failure still stands
                self._healthy = True
                self._last_error = None
        dt = time.monotonic() - t0
        logger.info(
            "%s/step %d %s in %s: %s, %d bytes in %.2fs (%.0f MB/s)",
            rec.namespace,
            rec.step,
            "durable" if rec.state == StepState.DURABLE else "uploaded",
            self.store.url,
            what,
            nbytes,
            dt,
            nbytes / max(dt, 1e-9) / 1e6,
            extra=step_fields(rec.namespace, rec.step, rec.attempt),
        )

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
        # Steps this node still uploads (a decider waiting for the other shares) are not left
        # over: their upload goes on.
        busy = {r.step for r in self.service.pending_uploads() if r.namespace == namespace}
        busy |= {k[1] for k in self._own_shares if k[0] == namespace}
        for step, keys in by_step.items():
            if (
                step < below
                and step not in busy
                and not any(k.endswith("/" + MARKER) for k in keys)
            ):
                self.store.delete(keys)
                logger.info(
                    "%s/step %d: removed an incomplete upload from %s",
                    namespace,
                    step,
                    self.store.url,
                )

    # -- reads ------------------------------------------------------------------------------
