"""Commit of a step whose ranks used several daemons (nodes): two phases, one decider.

Every rank seals its files with its own node's daemon, as for any save; no tensor bytes cross
nodes. The coordinator rank's daemon (the *decider*) then runs the commit (docs/design.md,
"Commit across nodes", has the crash cases)::

    prepare   decider -> every participant, through a tree (fanout.py): check that your share
              of the attempt is sealed, write MANIFEST.prepared.json (your share, the decider, the
              participants), answer with your files (slim) and their digest, and those of the
              participants you relayed to. Any failure: abort everywhere, the save fails.
    decide    the decider writes its own MANIFEST.json with the step's global record (the share
              table: per node its share's file names, bytes and the digest of their full
              records; where the DCP metadata and the table are kept: RingRecord). This write is
              the commit point.
    commit    decider -> the metadata's holders (with it), and through the tree to every other
              participant (without it): here is the global record; write your MANIFEST.json
              (a node that is not a holder keeps the table's digest, not the table).
              A node that does not answer is told again later, by whoever sent it the decision.

A participant shows the step (as committed, and so as "latest") only once it holds the decision;
one left in doubt asks (in_doubt.py). Every request carries the cluster-wide peer token, so each
goes to a current member of the ring only: a commit naming a node that is not a member fails
before anything is sent, and a prepare naming a decider or participant that is not one, or asking
to relay to a node outside the attempt, is refused.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

from tierckpt_core.errors import (
    NotAMemberError,
    PeerUnavailableError,
    ProtocolError,
    StepStateError,
    TierCkptError,
    UnavailableError,
)
from tierckpt_core.manifest import (
    FileRecord,
    RingRecord,
    Share,
    StepManifest,
    metadata_digest,
    share_digest,
    table_digest,
)
from tierckpt_core.protocol import (
    CommitRequest,
    DecideRequest,
    OutcomeResponse,
    PreparedShare,
    PrepareRequest,
    PrepareResponse,
    StepInfo,
)
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.fanout import FANOUT, CommitTree, split
from tierckpt_daemon.peers.in_doubt import (  # noqa: F401  (re-exported: tests use them)
    DECIDER_GONE_S,
    IN_DOUBT_AFTER_S,
    RESEND_FOR_S,
    RESOLVE_INTERVAL_S,
    Resolver,
)
from tierckpt_daemon.peers.membership import Members
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)


class GlobalCommitter:
    def __init__(
        self,
        service: TierService,
        client: PeerClient,
        *,
        node: str,
        decider_gone_s: float = DECIDER_GONE_S,
        resend_for_s: float = RESEND_FOR_S,
        fanout: int = FANOUT,
    ) -> None:
        self.service = service
        self.client = client
        self.members: Members = client.members
        self.node = node
        self.fanout = fanout
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="tierckpt-commit")
        self.resolver = Resolver(
            service,
            client,
            self,
            node=node,
            decider_gone_s=decider_gone_s,
            resend_for_s=resend_for_s,
        )
        self.tree = CommitTree(client, fanout, self.resolver.tell_later, self.resolver.abandon)

    def start(self) -> None:
        self.resolver.start()

    def stop(self) -> None:
        self.resolver.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.tree.close()

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

        base = PrepareRequest(
            coordinator=self.node,
            participants=participants,
            files=sorted(shares[self.node]),
            world_size=req.world_size,
        )
        own = self._pool.submit(self._prepare_share, namespace, step, attempt, base)
        others = {n: sorted(shares[n]) for n in participants if n != self.node}
        try:
            prepared = self.tree.prepare(namespace, step, attempt, base, others)
            prepared[self.node] = PreparedShare(files=own.result(), share_digest=None)
        except Exception as error:
            concurrent.futures.wait([own])
            self._abort_everywhere(namespace, step, attempt, participants)
            node = getattr(error, "node", self.node)
            cls = PeerUnavailableError if isinstance(error, UnavailableError) else StepStateError
            raise cls(
                f"{namespace}/step {step}: the commit across nodes {', '.join(participants)} "
                f"failed at {node} ({error}); nothing was committed, the save's files are reclaimed"
            ) from error
        entries: dict[str, Share] = {}
        for node in participants:
            share = prepared.get(node)
            got = share.files if share else []
            entries[node] = Share(
                # A participant's full records stay with it: it sent their digest.
                digest=share.share_digest
                if share is not None and share.share_digest is not None
                else share_digest(got),
                files=sorted(f.name for f in got),
                bytes=sum(f.length for f in got),
            )
            wrong = sorted({f.name for f in got} ^ set(shares[node]))
            if wrong:
                self._abort_everywhere(namespace, step, attempt, participants)
                raise ProtocolError(
                    f"{namespace}/step {step}: node {node} prepared files {wrong} it was not asked for"
                )
        holders = self._metadata_holders(participants)
        manifest = StepManifest(
            namespace=namespace,
            step=step,
            attempt=attempt,
            world_size=req.world_size,
            created_at=time.time(),
            # No file records: each node has its own, and the others' are in ``ring.shares``
            # (names, bytes, the digest of their records), so that the record a node keeps is
            # O(its share + nodes), not O(the job's files).
            files=[],
            metadata=req.metadata,
            coordinator=self.node,
            ring=RingRecord(
                shares=entries,
                shares_digest=table_digest(entries),
                metadata_digest=metadata_digest(req.metadata),
                metadata_holders=holders,
            ),
        )
        decision = DecideRequest(manifest=manifest, persist=persist)
        rec = self.decide(decision)  # the commit point: the decider's MANIFEST.json
        # The metadata goes to its holders only; every other node keeps its digest.
        without = DecideRequest(
            manifest=manifest.model_copy(update={"metadata": ""}), persist=persist
        )
        # Holders straight from the decider; everyone else through the tree.
        rest = [n for n in participants if n not in holders]
        self.tree.deliver(
            [(n, decision) for n in holders if n != self.node]
            + [
                (child, without.model_copy(update={"relay": subtree}))
                for child, subtree in split(rest, self.fanout)
            ]
        )
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

    def relay(self, req: DecideRequest) -> None:
        """Pass a decision this node took on to the nodes it relays to (the peer route)."""
        self.tree.relay(req)

    def _abort_everywhere(
        self, namespace: str, step: int, attempt: str, participants: list[str]
    ) -> None:
        """End the attempt here now, and tell the other participants in the background: the
        save fails at once, however long a participant takes to answer (one that never hears
        it aborts by itself once it asks, in doubt)."""

        def told(node: str, fut: concurrent.futures.Future[None]) -> None:
            error = None if fut.cancelled() else fut.exception()
            if error is not None:
                logger.warning(
                    "%s/step %d: could not tell %s to abort attempt %s: %s",
                    namespace,
                    step,
                    node,
                    attempt,
                    error,
                )

        for node in participants:
            if node == self.node:
                continue
            fut = self._pool.submit(self.client.abort, node, namespace, step, attempt)
            fut.add_done_callback(functools.partial(told, node))
        if self.node in participants:
            self.abort(namespace, step, attempt)

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
        strangers = sorted(set(req.subtree) - set(req.participants) - {self.node})
        if strangers or self.node in req.subtree or req.coordinator in req.subtree:
            raise ProtocolError(
                f"{where} asks to relay it to {strangers or 'itself or its decider'}, not "
                "other participants of the attempt: refused"
            )
        subtree = self._pool.submit(
            self.tree.prepare, namespace, step, attempt, req, dict(req.subtree)
        )
        try:
            files, digest = _slim_share(self._prepare_share(namespace, step, attempt, req))
        finally:
            concurrent.futures.wait([subtree])
        try:
            below = subtree.result()
        except TierCkptError as e:
            node = getattr(e, "node", "?")
            raise StepStateError(f"{where}: participant {node} failed: {e}") from e
        return PrepareResponse(files=files, share_digest=digest, subtree=below)

    def _prepare_share(
        self, namespace: str, step: int, attempt: str, req: PrepareRequest
    ) -> list[FileRecord]:
        return self.service.prepare_share(
            namespace,
            step,
            attempt,
            files=req.files,
            coordinator=req.coordinator,
            participants=req.participants,
            world_size=req.world_size,
        )

    def decide(self, req: DecideRequest, *, as_prepared: bool = False) -> StepRecord:
        """Commit this node's share of a step with the decider's global record (idempotent).
        ``as_prepared``: see :meth:`TierService.take_decision`."""
        m = req.manifest
        if m.attempt is None or m.coordinator is None:
            raise ProtocolError(f"{m.namespace}/step {m.step}: a decision without attempt/decider")
        return self.service.take_decision(m, persist=req.persist, as_prepared=as_prepared)

    def abort(self, namespace: str, step: int, attempt: str) -> None:
        self.service.abort_attempt(namespace, step, attempt)

    def outcome(self, namespace: str, step: int, attempt: str) -> OutcomeResponse:
        return self.service.attempt_outcome(namespace, step, attempt)


def _slim_share(files: list[FileRecord]) -> tuple[list[FileRecord], str]:
    """A node's share as the global record carries it (slim records), and its digest."""
    return [f.slimmed() for f in files], share_digest(files)
