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

Every request carries the cluster-wide peer token, so each goes to a current member of the ring
only: a commit naming a node that is not a member fails before anything is sent, a prepare naming
a decider or participant that is not one is refused, and the resolver never dials a non-member. A
prepared attempt whose decider has left the ring is asked about of every member (the decider's
node may be back under another address, holding the decision) once it has been gone for
``decider_gone_s``, and aborted if none holds it committed: it is not kept in doubt forever.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tierckpt_core.errors import (
    NotAMemberError,
    PeerUnavailableError,
    ProtocolError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
    UnavailableError,
)
from tierckpt_core.integrity import checksum_file_blocks
from tierckpt_core.manifest import (
    FileRecord,
    RingRecord,
    StepManifest,
    metadata_digest,
    share_digest,
)
from tierckpt_core.protocol import (
    CommitRequest,
    DecideRequest,
    OutcomeResponse,
    PrepareRequest,
    PrepareResponse,
    StepInfo,
    StepState,
)
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Members
from tierckpt_daemon.tier.records import StepRecord, read_manifest, write_prepared
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 2.0  # how often undelivered decisions and prepared attempts are looked at
IN_DOUBT_AFTER_S = 5.0  # a prepared attempt older than this asks its decider
DECIDER_GONE_S = 600.0  # a decider not a member this long: its prepared attempts are swept


class GlobalCommitter:
    def __init__(
        self,
        service: TierService,
        client: PeerClient,
        *,
        node: str,
        decider_gone_s: float = DECIDER_GONE_S,
    ) -> None:
        self.service = service
        self.client = client
        self.members: Members = client.members
        self.node = node
        self.decider_gone_s = decider_gone_s
        # (namespace, step, attempt) of a prepared attempt -> when its decider was first seen
        # not to be a member (monotonic); only the resolver thread touches it.
        self._gone: dict[tuple[str, int, str], float] = {}
        self._preparing: set[tuple[str, int, str]] = set()  # under the service's lock
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
        # Before anything is sent: every request below carries the peer token.
        for node in participants:
            if not self.members.is_member(node):
                raise NotAMemberError(
                    f"{namespace}/step {step}: the commit names node {node!r} (for "
                    f"{', '.join(sorted(shares[node])[:4])}), which is not a member of the ring "
                    f"({self.members.membership.describe()}); nothing was sent to it. Each "
                    "rank's node is its daemon's TIERCKPT_NODE_NAME"
                )
        self.service.writing_record(namespace, step, attempt)  # the decider's own part exists
        # The decider's index is the one that decides "latest": a committed step is on it.
        self.service.refuse_overwrite(namespace, step, req)
        persist = self.service.wants_persist(namespace, step, req.persist)
        t0 = time.monotonic()

        def prepare(node: str) -> tuple[list[FileRecord], str]:
            prep = PrepareRequest(
                coordinator=self.node,
                participants=participants,
                files=sorted(shares[node]),
                world_size=req.world_size,
            )
            if node == self.node:
                return _slim_share(self._prepare_share(namespace, step, attempt, prep))
            got = self.client.prepare(node, namespace, step, attempt, prep)
            if got.share_digest is None:  # a daemon from before RingRecord: full records
                return _slim_share(got.files)
            return [f.slimmed() for f in got.files], got.share_digest

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
        digests: dict[str, str] = {}
        for node in participants:
            got, digests[node] = futures[node].result()
            wrong = sorted({f.name for f in got} ^ set(shares[node]))
            if wrong:
                self._abort_everywhere(namespace, step, attempt, participants)
                raise ProtocolError(
                    f"{namespace}/step {step}: node {node} prepared files {wrong} it was not asked for"
                )
            files.extend(f.model_copy(update={"node": node}) for f in got)
        holders = self._metadata_holders(participants)
        manifest = StepManifest(
            namespace=namespace,
            step=step,
            attempt=attempt,
            world_size=req.world_size,
            created_at=time.time(),
            files=sorted(files, key=lambda f: f.name),
            metadata=req.metadata,
            coordinator=self.node,
            ring=RingRecord(
                shares=digests,
                metadata_digest=metadata_digest(req.metadata),
                metadata_holders=holders,
            ),
        )
        decision = DecideRequest(manifest=manifest, persist=persist)
        rec = self.decide(decision)  # the commit point: the decider's MANIFEST.json
        # The metadata goes to its holders only; every other node keeps its digest.
        without = DecideRequest(
            manifest=manifest.model_copy(update={"metadata": {}}), persist=persist
        )
        decisions = {n: decision if n in holders else without for n in participants}
        others = [n for n in participants if n != self.node]
        delivered = {n: self._pool.submit(self.client.decide, n, decisions[n]) for n in others}
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
                    self._undelivered[(node, namespace, step, attempt)] = decisions[node]
        logger.info(
            "%s/step %d committed across %d nodes (%s) in %.1f ms",
            namespace,
            step,
            len(participants),
            ", ".join(participants),
            (time.monotonic() - t0) * 1e3,
        )
        return rec.info()

    def _metadata_holders(self, participants: list[str]) -> list[str]:
        """Who keeps a step's DCP metadata: the decider and the participants after it in the
        ring's order, as many as the step has replicas (at least one more, so that losing the
        decider's node does not lose the metadata of a step every other node still holds)."""
        i = participants.index(self.node)
        after = participants[i + 1 :] + participants[:i]
        return [self.node, *after[: max(1, self.service.replicas)]]

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
    ) -> PrepareResponse:
        """A decider's prepare of this node's share (the peer route). Refused: an empty share (a
        node takes part because it holds files), and a decider or participant that is not a
        member of the ring (this node would send the token there, asking how the attempt
        ended)."""
        where = f"{namespace}/step {step}: prepare of attempt {attempt}"
        if not req.files:
            raise ProtocolError(f"{where} names no file: a participant holds a share of the save")
        for node in dict.fromkeys([req.coordinator, *req.participants]):
            role = "decider" if node == req.coordinator else "participant"
            if not self.members.is_member(node):
                raise NotAMemberError(
                    f"{where} names {role} {node!r}, which is not a member of the ring "
                    f"({self.members.membership.describe()}): refused"
                )
        files, digest = _slim_share(self._prepare_share(namespace, step, attempt, req))
        return PrepareResponse(files=files, share_digest=digest)

    def _prepare_share(
        self, namespace: str, step: int, attempt: str, req: PrepareRequest
    ) -> list[FileRecord]:
        svc, key = self.service, (namespace, step, attempt)
        with svc.lock:
            rec = svc.writing_record(namespace, step, attempt)
            if rec.prepared_at is not None or key in self._preparing:
                return self._prepared_again(rec, req)
            svc.keep_only(rec, req.files)
            # Files the writer sent checksums for keep them (taken right after the copy).
            todo = [
                (f.name, str(rec.dir / f.name), f.length)
                for f in rec.files.values()
                if f.checksum is None or f.blocks is None
            ]
            self._preparing.add(key)
        try:
            # Checksum the share now, off the trainers' stall and right after their copy: the
            # global record carries every file's checksum to peers and the persistent tier.
            sums = {name: checksum_file_blocks(path, length) for name, path, length in todo}
            with svc.lock:
                if svc.index.writing.get(key) is not rec:
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
        finally:
            with svc.lock:
                self._preparing.discard(key)

    def _prepared_again(self, rec: StepRecord, req: PrepareRequest) -> list[FileRecord]:
        """A second prepare of an attempt (caller holds the lock): the same one again gets the
        same answer; any other is refused, so that no one replaces the decider's prepare of an
        attempt in flight (dropping its sealed files, or naming another decider)."""
        same = (
            rec.prepared_at is not None
            and rec.coordinator == req.coordinator
            and rec.participants == list(req.participants)
            and sorted(rec.files) == sorted(req.files)
        )
        if not same:
            raise StepStateError(
                f"{rec.namespace}/step {rec.step}: attempt {rec.attempt} is already "
                + (
                    f"prepared by decider {rec.coordinator} with files {sorted(rec.files)[:8]}"
                    if rec.prepared_at is not None
                    else "being prepared"
                )
                + f"; a prepare by {req.coordinator} with files {sorted(req.files)[:8]} is refused"
            )
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
            # Only the decision of the decider that prepared the attempt, over its participants.
            strangers = sorted({f.node or "" for f in m.files} - set(rec.participants))
            if m.coordinator != rec.coordinator or (rec.participants and strangers):
                raise StepStateError(
                    f"{m.namespace}/step {m.step}: a decision for attempt {m.attempt} by "
                    f"{m.coordinator} (files on {', '.join(strangers) or 'its participants'}) "
                    f"does not match its prepare by decider {rec.coordinator} with participants "
                    f"{', '.join(rec.participants)}: refused"
                )
            mine = {f.name for f in m.share(self.node)}
            if mine != set(rec.files):
                raise StepStateError(
                    f"{m.namespace}/step {m.step}: the decision lists {sorted(mine)} on "
                    f"{self.node}, which prepared {sorted(rec.files)}"
                )
            rec.remote = {
                f.name: f.slimmed() if m.ring is not None else f
                for f in m.files
                if f.name not in mine
            }
            rec.ring = m.ring
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
                except NotAMemberError as e:
                    # It left the ring: if it comes back it asks (in doubt) how the attempt ended.
                    logger.warning("decision for %s not delivered: %s", key, e)
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
        keys = {(r.namespace, r.step, r.attempt) for r in doubtful}
        for key in set(self._gone) - keys:  # resolved, or ended otherwise
            del self._gone[key]
        if not doubtful:
            return
        try:
            members = self.members.current()
        except PeerUnavailableError as e:  # DNS: nothing is dialed, nothing is swept
            logger.info("prepared attempts wait: the ring's members are unknown now (%s)", e)
            return
        for rec in doubtful:
            self._resolve(rec, members)

    def _resolve(self, rec: StepRecord, members: frozenset[str]) -> None:
        ns, step, attempt = rec.namespace, rec.step, rec.attempt
        if rec.coordinator == self.node:
            # This daemon was the decider and has no MANIFEST.json for it: it never decided.
            self.abort(ns, step, attempt)
            return
        key = (ns, step, attempt)
        if rec.coordinator in members:
            self._gone.pop(key, None)
            ask = [rec.coordinator, *rec.participants]
        else:
            # Never dialed (the token goes to members only). Its participants may hold the
            # decision; once it has been gone a while, so may any member (the decider's node
            # back under another address): then ask them all, once, and abort if none does.
            gone_at = self._gone.setdefault(key, time.monotonic())
            if time.monotonic() - gone_at < self.decider_gone_s:
                ask = list(rec.participants)
            else:
                ask = sorted(members)
        if self._ask_about(rec, [n for n in ask if n in members]):
            return
        gone_for = time.monotonic() - self._gone.get(key, time.monotonic())
        if rec.coordinator not in members and gone_for >= self.decider_gone_s:
            logger.warning(
                "%s/step %d: attempt %s was prepared by decider %s, which has not been a member "
                "of the ring for %.0f s, and no member holds it committed: aborting it",
                ns,
                step,
                attempt,
                rec.coordinator,
                gone_for,
            )
            self._gone.pop(key, None)
            self.abort(ns, step, attempt)

    def _ask_about(self, rec: StepRecord, nodes: list[str]) -> bool:
        """Ask ``nodes`` (members) how ``rec``'s attempt ended: take the decision if one holds
        it committed; abort if its decider (asked) does not know it and every other answered.
        True when the attempt was settled either way."""
        ns, step, attempt = rec.namespace, rec.step, rec.attempt
        asked: dict[str, OutcomeResponse | None] = {}
        for node in nodes:
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
                return True
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
            return True
        return False


def _slim_share(files: list[FileRecord]) -> tuple[list[FileRecord], str]:
    """A node's share as the global record carries it (slim records), and its digest."""
    return [f.slimmed() for f in files], share_digest(files)
