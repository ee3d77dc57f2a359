"""Commit of a step whose ranks used several daemons (nodes): two phases, one decider.

Every rank seals its files with its own node's daemon, as for any save; no tensor bytes cross
nodes. The coordinator rank's daemon (the *decider*) then runs the commit (docs/design.md,
"Commit across nodes", has the crash cases)::

    prepare   decider -> every participant (itself included), in parallel: check that your share
              of the attempt is sealed, write MANIFEST.prepared.json (your share, the decider, the
              participants), answer with your files. Any failure: abort everywhere, the save fails.
    decide    the decider writes its own MANIFEST.json with the step's global record (every
              file, with the node that holds it). This write is the commit point.
    commit    decider -> every other participant: here is the global record; write your
              MANIFEST.json. A participant that does not answer gets the decision again later.

A participant shows the step (as committed, and so as "latest") only once it holds the decision. A
participant that restarts, or waits too long, with a prepared attempt asks the decider how it
ended, and, if the decider no longer knows, the other participants; it aborts only when the
decider says the attempt is not committed and no participant holds it committed, and never
guesses while the decider cannot be reached. The decider aborts its own prepared attempts found at
restart: it never decided them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tierckpt_core.errors import (
    PeerUnavailableError,
    ProtocolError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
    UnavailableError,
)
from tierckpt_core.integrity import checksum_file_blocks
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_core.protocol import (
    CommitRequest,
    DecideRequest,
    OutcomeResponse,
    PrepareRequest,
    StepInfo,
    StepState,
)
from tierckpt_daemon.peer_client import PeerClient
from tierckpt_daemon.records import StepRecord, read_manifest, write_prepared
from tierckpt_daemon.service import TierService

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 2.0  # how often undelivered decisions and prepared attempts are looked at
IN_DOUBT_AFTER_S = 5.0  # a prepared attempt older than this asks its decider


class GlobalCommitter:
    def __init__(self, service: TierService, client: PeerClient, *, node: str) -> None:
        self.service = service
        self.client = client
        self.node = node
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="tierckpt-commit")
        self._cv = threading.Condition()
        self._undelivered: dict[tuple[str, str, int, str], DecideRequest] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="tierckpt-resolver", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- the decider ------------------------------------------------------------------------
    def commit(self, namespace: str, step: int, attempt: str, req: CommitRequest) -> StepInfo:
        """Commit a save attempt whose files lie on the daemons ``req.nodes`` names."""
        nodes = req.nodes or {}
        unplaced = sorted(set(req.files) - set(nodes))
        if unplaced:
            raise ProtocolError(
                f"{namespace}/step {step}: the commit names no node for {', '.join(unplaced[:8])}"
            )
        shares: dict[str, list[str]] = {self.node: []}
        for name in req.files:
            shares.setdefault(nodes[name], []).append(name)
        participants = sorted(shares)
        self.service.writing_record(namespace, step, attempt)  # the decider's own part exists
        # The decider's index is the one that decides "latest": a committed step is on it.
        self.service.refuse_overwrite(namespace, step, req)
        persist = self.service.wants_persist(namespace, step, req.persist)
        t0 = time.monotonic()

        def prepare(node: str) -> list[FileRecord]:
            prep = PrepareRequest(
                coordinator=self.node,
                participants=participants,
                files=sorted(shares[node]),
                world_size=req.world_size,
            )
            if node == self.node:
                return self.prepare(namespace, step, attempt, prep)
            return self.client.prepare(node, namespace, step, attempt, prep).files

        futures = {n: self._pool.submit(prepare, n) for n in participants}
        concurrent.futures.wait(futures.values())
        failed = {n: f.exception() for n, f in futures.items() if f.exception() is not None}
        if failed:
            self._abort_everywhere(namespace, step, attempt, participants)
            node, error = next(iter(sorted(failed.items())))
            cls = PeerUnavailableError if isinstance(error, UnavailableError) else StepStateError
            raise cls(
                f"{namespace}/step {step}: the commit across nodes {', '.join(participants)} "
                f"failed at {node} ({error}); nothing was committed, the save's files are reclaimed"
            ) from error
        files: list[FileRecord] = []
        for node in participants:
            got = futures[node].result()
            wrong = sorted({f.name for f in got} ^ set(shares[node]))
            if wrong:
                self._abort_everywhere(namespace, step, attempt, participants)
                raise ProtocolError(
                    f"{namespace}/step {step}: node {node} prepared files {wrong} it was not asked for"
                )
            files.extend(f.model_copy(update={"node": node, "size": None}) for f in got)
        manifest = StepManifest(
            namespace=namespace,
            step=step,
            attempt=attempt,
            world_size=req.world_size,
            created_at=time.time(),
            files=sorted(files, key=lambda f: f.name),
            metadata=req.metadata,
            coordinator=self.node,
        )
        decision = DecideRequest(manifest=manifest, persist=persist)
        rec = self.decide(decision)  # the commit point: the decider's MANIFEST.json
        others = [n for n in participants if n != self.node]
        delivered = {n: self._pool.submit(self.client.decide, n, decision) for n in others}
        concurrent.futures.wait(delivered.values())
        for node, fut in delivered.items():
            if fut.exception() is not None:
                logger.warning(
                    "%s/step %d is committed; participant %s did not take the decision yet (%s): "
                    "it is told again until it does",
                    namespace,
                    step,
                    node,
                    fut.exception(),
                )
                with self._cv:
                    self._undelivered[(node, namespace, step, attempt)] = decision
        logger.info(
            "%s/step %d committed across %d nodes (%s) in %.1f ms",
            namespace,
            step,
            len(participants),
            ", ".join(participants),
            (time.monotonic() - t0) * 1e3,
        )
        return rec.info()

    def _abort_everywhere(
        self, namespace: str, step: int, attempt: str, participants: list[str]
    ) -> None:
        def abort(node: str) -> None:
            if node == self.node:
                self.abort(namespace, step, attempt)
            else:
                self.client.abort(node, namespace, step, attempt)

        for node, fut in [(n, self._pool.submit(abort, n)) for n in participants]:
            try:
                fut.result()
            except TierCkptError as e:  # it aborts by itself once it asks (in doubt)
                logger.warning(
                    "%s/step %d: could not tell %s to abort attempt %s: %s",
                    namespace,
                    step,
                    node,
                    attempt,
                    e,
                )

    # -- a participant (the decider is one too) --------------------------------------------
    def prepare(
        self, namespace: str, step: int, attempt: str, req: PrepareRequest
    ) -> list[FileRecord]:
        svc = self.service
        with svc.lock:
            rec = svc.writing_record(namespace, step, attempt)
            svc.keep_only(rec, req.files)
            # Files the writer sent checksums for keep them (taken right after the copy).
            todo = [
                (f.name, str(rec.dir / f.name), f.length)
                for f in rec.files.values()
                if f.checksum is None or f.blocks is None
            ]
        # Checksum the share now, off the trainers' stall and right after their copy: the global
        # record carries every file's checksum to peers and the persistent tier from here on.
        sums = {name: checksum_file_blocks(path, length) for name, path, length in todo}
        with svc.lock:
            if svc.index.writing.get((namespace, step, attempt)) is not rec:
                raise StepStateError(
                    f"{namespace}/step {step}: attempt {attempt} ended while it was prepared"
                )
            for name, (whole, size, blocks) in sums.items():
                f = rec.files[name]
                f.checksum, f.block_size, f.blocks = whole, size, blocks
            rec.coordinator = req.coordinator
            rec.participants = list(req.participants)
            rec.world_size = req.world_size
            rec.prepared_at = time.time()
            for f in rec.files.values():
                f.node = self.node
            write_prepared(rec)
            return [f.model_copy(update={"size": None}) for f in rec.sorted_files()]

    def decide(self, req: DecideRequest) -> StepRecord:
        """Commit this node's share of a step with the decider's global record (idempotent)."""
        m, svc = req.manifest, self.service
        if m.attempt is None or m.coordinator is None:
            raise ProtocolError(f"{m.namespace}/step {m.step}: a decision without attempt/decider")
        with svc.lock:
            current = svc.index.committed.get(m.namespace, {}).get(m.step)
            if current is not None and current.attempt == m.attempt:
                return current
            rec = svc.writing_record(m.namespace, m.step, m.attempt)
            if rec.prepared_at is None:
                raise StepStateError(
                    f"{m.namespace}/step {m.step}: attempt {m.attempt} was never prepared here"
                )
            mine = {f.name for f in m.share(self.node)}
            if mine != set(rec.files):
                raise StepStateError(
                    f"{m.namespace}/step {m.step}: the decision lists {sorted(mine)} on "
                    f"{self.node}, which prepared {sorted(rec.files)}"
                )
            rec.remote = {f.name: f for f in m.files if f.name not in mine}
            rec.coordinator = m.coordinator
            rec.participants = []
            rec.prepared_at = None
            rec.world_size = m.world_size
            rec.learn_checksums({f.name: f.checksum for f in m.files if f.checksum})
            rec = svc.install(rec, m.metadata, persist=req.persist, replicate=True)
        svc.freshness.committed(m.namespace, rec.committed_at)
        svc.notify_committed(rec)
        return rec

    def abort(self, namespace: str, step: int, attempt: str) -> None:
        svc = self.service
        with svc.lock:
            rec = svc.index.writing.pop((namespace, step, attempt), None)
            if rec is not None:
                logger.warning(
                    "%s/step %d: attempt %s aborted; its files are reclaimed",
                    namespace,
                    step,
                    attempt,
                )
                svc.index.reclaim_dir(rec.dir)

    def outcome(self, namespace: str, step: int, attempt: str) -> OutcomeResponse:
        svc = self.service
        with svc.lock:
            for rec in svc.index.records_of(namespace, step):
                if rec.attempt == attempt and rec.state != StepState.WRITING:
                    metadata = read_manifest(rec.manifest_path()).metadata
                    manifest = rec.manifest(metadata).portable()
                    return OutcomeResponse(
                        outcome="committed", manifest=manifest, persist=rec.persist_pending
                    )
            writing = svc.index.writing.get((namespace, step, attempt))
        if writing is None:
            return OutcomeResponse(outcome="unknown")
        return OutcomeResponse(outcome="prepared" if writing.prepared_at is not None else "writing")

    # -- decisions not yet delivered, attempts in doubt ------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(RESOLVE_INTERVAL_S)
                if self._stop:
                    return
                undelivered = dict(self._undelivered)
            for key, decision in undelivered.items():
                try:
                    self.client.decide(key[0], decision)
                except TierCkptError as e:
                    logger.debug("decision for %s not delivered yet: %s", key, e)
                    continue
                with self._cv:
                    self._undelivered.pop(key, None)
            try:
                self.resolve_in_doubt()
            except Exception:  # never kill the resolver: say so and try again next round
                logger.exception("resolving prepared attempts failed")

    def resolve_in_doubt(self) -> None:
        now = time.time()
        with self.service.lock:
            doubtful = [
                r
                for r in self.service.index.writing.values()
                if r.prepared_at is not None and now - r.prepared_at > IN_DOUBT_AFTER_S
            ]
        for rec in doubtful:
            self._resolve(rec)

    def _resolve(self, rec: StepRecord) -> None:
        ns, step, attempt = rec.namespace, rec.step, rec.attempt
        if rec.coordinator == self.node:
            # This daemon was the decider and has no MANIFEST.json for it: it never decided.
            self.abort(ns, step, attempt)
            return
        asked: dict[str, OutcomeResponse | None] = {}
        for node in [rec.coordinator or "", *rec.participants]:
            if not node or node == self.node or node in asked:
                continue
            try:
                asked[node] = self.client.outcome(node, ns, step, attempt)
            except TierCkptError as e:
                logger.info(
                    "%s/step %d: cannot ask %s about attempt %s: %s", ns, step, node, attempt, e
                )
                asked[node] = None
            answer = asked[node]
            if answer is not None and answer.outcome == "committed" and answer.manifest:
                logger.info(
                    "%s/step %d: attempt %s was committed (as %s says); committing it here",
                    ns,
                    step,
                    attempt,
                    node,
                )
                try:
                    self.decide(DecideRequest(manifest=answer.manifest, persist=answer.persist))
                except (StepNotFoundError, StepStateError) as e:
                    logger.warning("%s/step %d: cannot take the decision: %s", ns, step, e)
                return
        decider = asked.get(rec.coordinator or "")
        if (
            decider is not None
            and decider.outcome == "unknown"
            and all(a is not None for a in asked.values())
        ):
            logger.warning(
                "%s/step %d: attempt %s was never committed (its decider %s does not know it, "
                "and no participant holds it committed): aborting it",
                ns,
                step,
                attempt,
                rec.coordinator,
            )
            self.abort(ns, step, attempt)
