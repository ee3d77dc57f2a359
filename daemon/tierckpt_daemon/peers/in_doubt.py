"""The committer's background round (every ``RESOLVE_INTERVAL_S``): decisions a participant
did not take yet are told again, and prepared attempts left in doubt are settled.

A participant that restarts, or waits too long, with a prepared attempt asks the decider how it
ended, and, if the decider no longer knows, the other participants; it aborts only when the
decider says the attempt is not committed and no participant holds it committed, and never
guesses while the decider cannot be reached. The decider aborts its own prepared attempts found at
restart: it never decided them. A prepared attempt whose decider has left the ring is asked about
of every member (the decider's node may be back under another address, holding the decision) once
it has been gone for ``decider_gone_s``, and aborted if none holds it committed.

A decision is told again less and less often (from ``RESOLVE_INTERVAL_S`` doubling up to
``RESEND_MAX_S``), and no longer once the participant answers that it cannot take it (it has no
such attempt prepared: a replacement node, an attempt it aborted or superseded; or it left the
ring) or after ``resend_for_s``: each such end is a WARNING and counts in
``tierckpt_decision_deliveries_abandoned_total{reason}``. A participant that still holds the
attempt prepared settles it itself by asking (above), so nothing waits on a re-send.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from tierckpt_core.errors import (
    NotAMemberError,
    PeerUnavailableError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
)
from tierckpt_core.manifest import StepManifest
from tierckpt_core.protocol import DecideRequest, OutcomeResponse
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Members
from tierckpt_daemon.peers.ring_table import fetch_table
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

RESOLVE_INTERVAL_S = 2.0  # how often undelivered decisions and prepared attempts are looked at
IN_DOUBT_AFTER_S = 5.0  # a prepared attempt older than this asks its decider
DECIDER_GONE_S = 600.0  # a decider not a member this long: its prepared attempts are swept
RESEND_FOR_S = 900.0  # a decision not delivered this long is no longer told again
RESEND_MAX_S = 60.0  # the longest wait between two re-sends of one decision

# A participant's answers that a decision sent again cannot change: it holds no such attempt
# prepared (StepNotFoundError: "no save in progress"), or one that does not match the decision
# (StepStateError), or it is no longer a member (NotAMemberError: nothing is sent).
PERMANENT = (StepNotFoundError, StepStateError, NotAMemberError)


def abandon_reason(e: BaseException) -> str | None:
    """The ``reason`` label when ``e`` says a decision can never be delivered, else None."""
    if isinstance(e, NotAMemberError):
        return "not_member"
    if isinstance(e, PERMANENT):
        return "refused"
    return None


@dataclass
class _Resend:
    decision: DecideRequest
    since: float  # monotonic: when it was first left to the re-send
    due: float  # monotonic: when it is sent next
    tries: int = 0


class Settle(Protocol):
    """How this node ends an attempt: take a decision, or abort (the committer)."""

    def decide(self, req: DecideRequest, *, as_prepared: bool = False) -> StepRecord: ...

    def abort(self, namespace: str, step: int, attempt: str) -> None: ...


class Resolver:
    def __init__(
        self,
        service: TierService,
        client: PeerClient,
        settle: Settle,
        *,
        node: str,
        decider_gone_s: float = DECIDER_GONE_S,
        resend_for_s: float = RESEND_FOR_S,
    ) -> None:
        self.service = service
        self.client = client
        self.members: Members = client.members
        self.settle = settle
        self.node = node
        self.decider_gone_s = decider_gone_s
        self.resend_for_s = resend_for_s
        # (namespace, step, attempt) of a prepared attempt -> when its decider was first seen
        # not to be a member (monotonic); only the resolver thread touches it.
        self._gone: dict[tuple[str, int, str], float] = {}
        self._cv = threading.Condition()
        self._undelivered: dict[tuple[str, str, int, str], _Resend] = {}
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

    def tell_later(self, node: str, decision: DecideRequest) -> None:
        """``node`` did not take ``decision`` (with what it relays): tell it again later."""
        m = decision.manifest
        now = time.monotonic()
        with self._cv:
            key = (node, m.namespace, m.step, m.attempt or "")
            if key not in self._undelivered:
                self._undelivered[key] = _Resend(decision, now, now + RESOLVE_INTERVAL_S)

    def abandon(self, node: str, decision: DecideRequest, reason: str, e: BaseException) -> None:
        """Stop telling ``node`` ``decision``: a WARNING and the metric."""
        m = decision.manifest
        logger.warning(
            "%s/step %d: the decision on attempt %s is no longer sent to %s (%s: %s); if it "
            "still holds the attempt prepared it settles it by asking",
            m.namespace,
            m.step,
            m.attempt,
            node,
            reason,
            e,
        )
        self.service.metrics.decision_deliveries_abandoned.labels(reason=reason).inc()

    def pending_deliveries(self) -> int:
        with self._cv:
            return len(self._undelivered)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(RESOLVE_INTERVAL_S)
                if self._stop:
                    return
                now = time.monotonic()
                due = {k: r for k, r in self._undelivered.items() if r.due <= now}
            for key, resend in due.items():
                self._resend(key, resend)
            try:
                self.resolve_in_doubt()
            except Exception:  # never kill the resolver: say so and try again next round
                logger.exception("resolving prepared attempts failed")

    def _resend(self, key: tuple[str, str, int, str], resend: _Resend) -> None:
        node = key[0]
        try:
            # One try (bounded by the peer timeout): the next is rounds away anyway.
            self.client.decide(node, resend.decision, attempts=1)
        except TierCkptError as e:
            reason = abandon_reason(e)
            now = time.monotonic()
            if reason is None and now - resend.since < self.resend_for_s:
                resend.tries += 1
                wait = min(RESOLVE_INTERVAL_S * 2**resend.tries, RESEND_MAX_S)
                resend.due = now + wait
                logger.info("decision for %s not delivered yet (next in %.0f s): %s", key, wait, e)
                return
            self.abandon(node, resend.decision, reason or "expired", e)
        with self._cv:
            self._undelivered.pop(key, None)

    def resolve_in_doubt(self) -> None:
        doubtful = self.service.prepared_attempts(older_than_s=IN_DOUBT_AFTER_S)
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
            self.settle.abort(ns, step, attempt)
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
            self.settle.abort(ns, step, attempt)

    def _with_table(self, m: StepManifest) -> StepManifest:
        """A decision learnt from a node that keeps only its share table's digest, with the
        table (from the step's holders, checked against it): taking it checks this node's share
        and the participants against the table."""
        if m.ring is None or m.ring.has_table:
            return m
        ring = fetch_table(self.client, self.node, m.namespace, m.step, m.ring)
        return m.model_copy(update={"ring": ring})

    def _take(self, decision: DecideRequest, *, as_prepared: bool = False) -> None:
        m = decision.manifest
        try:
            self.settle.decide(decision, as_prepared=as_prepared)
        except (StepNotFoundError, StepStateError) as e:
            logger.warning("%s/step %d: cannot take the decision: %s", m.namespace, m.step, e)

    def _ask_about(self, rec: StepRecord, nodes: list[str]) -> bool:
        """Ask ``nodes`` (members) how ``rec``'s attempt ended: take the decision if one holds
        it committed; abort if its decider (asked) does not know it and every other answered.
        True when the attempt was settled either way."""
        ns, step, attempt = rec.namespace, rec.step, rec.attempt
        asked: dict[str, OutcomeResponse | None] = {}
        without_table: tuple[str, OutcomeResponse] | None = None
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
                try:  # a participant that is not a holder answers with its table's digest only
                    manifest = self._with_table(answer.manifest)
                except TierCkptError as e:
                    logger.info("%s/step %d: %s's answer: %s", ns, step, node, e)
                    without_table = without_table or (node, answer)
                    continue
                logger.info(
                    "%s/step %d: attempt %s was committed (as %s says); committing it here",
                    ns,
                    step,
                    attempt,
                    node,
                )
                self._take(DecideRequest(manifest=manifest, persist=answer.persist))
                return True
        if without_table is not None:
            # Committed, and every holder of the share table is down or in doubt too (the
            # decider died right after deciding; the other holder is this node, or missed the
            # decision as well). Waiting for them could be forever: take the decision on this
            # node's share as prepared for this very attempt, and keep the table's digest only
            # (the table and the metadata are fetched from the holders when a reader needs
            # them; a share that did not match its digest would fail that read, loudly).
            node, answer = without_table
            assert answer.manifest is not None
            logger.warning(
                "%s/step %d: attempt %s was committed (as %s says), and no holder of its share "
                "table (%s) can give it: committing this node's share as prepared, with the "
                "table's digest only",
                ns,
                step,
                attempt,
                node,
                ", ".join(answer.manifest.ring.metadata_holders if answer.manifest.ring else []),
            )
            self._take(
                DecideRequest(manifest=answer.manifest, persist=answer.persist), as_prepared=True
            )
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
            self.settle.abort(ns, step, attempt)
            return True
        return False
