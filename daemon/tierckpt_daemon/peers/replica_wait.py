"""Wait until every share of a committed step has its replicas on peers: what a save made with
``wait="replicated"`` waits for before it reports success (docs/operations.md, "What an
acknowledged save survives").

A step of one node: its record here says it (``replication_pending`` done, ``replicated_to``
not empty). A step spanning nodes: each node replicates its own share, so this node (the
decider, which keeps the step's share table) asks every other participant what it holds
(``inventory``, one try each round) until each shows its share replicated. A share whose
replication ended with no replica (no peer was a member, every peer refused it) fails the wait at
once, naming it; one still under way after ``timeout_s`` fails it too. Nothing here changes a
step: the wait only reports.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tierckpt_core.errors import NotReplicatedError, StepStateError, TierCkptError
from tierckpt_core.protocol import NodeStep, StepInfo
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often this node's record is looked at
ASK_EVERY_S = 0.5  # how often the other participants are asked
MAX_WAIT_S = 3600.0


class ReplicaWait:
    def __init__(
        self,
        service: TierService,
        client: PeerClient,
        *,
        node: str,
        last_error: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.service = service
        self.client = client
        self.node = node
        self.last_error = last_error  # the replicator's, for why this node's share waits

    def wait(
        self, namespace: str, step: int, timeout_s: float, *, owner: str | None = None
    ) -> StepInfo:
        """This node's record of the step, once every share has its replicas; StepStateError
        when one cannot get any, or when ``timeout_s`` passes first (saying which)."""
        if not 0 < timeout_s <= MAX_WAIT_S:
            raise ValueError(f"timeout must be in (0, {MAX_WAIT_S:.0f}] seconds, got {timeout_s}")
        where = f"{namespace}/step {step}"
        if self.service.replicas < 1:
            raise StepStateError(
                f"{where}: a save that waits for its replicas needs replication, and this "
                "daemon replicates to no peer (TIERCKPT_REPLICAS=0)"
            )
        deadline = time.monotonic() + timeout_s
        theirs: dict[str, str | None] = {}  # the other participants' last answers
        asked_at = -float("inf")
        while True:
            rec = self.service.record(namespace, step, owner=owner)
            if time.monotonic() - asked_at >= ASK_EVERY_S:
                asked_at = time.monotonic()
                theirs = {n: self._ask(n, namespace, step) for n in _nodes(rec) if n != self.node}
            why = {n: w for n, w in theirs.items() if w is not None}
            mine = _short(rec.replication_pending, rec.replicated_to)
            if mine is not None:
                error = self.last_error() if rec.replication_pending else None
                if error and error.startswith(f"{where}:"):  # (this step's, not another's)
                    mine = f"{mine} (its last try: {error[len(where) + 1 :].strip()})"
                why[self.node] = mine
            failed = {n: w for n, w in why.items() if w.startswith("no replica")}
            if failed:
                raise NotReplicatedError(
                    f"{where} is committed, but not replicated: {_say(failed)} (is another "
                    "daemon of the ring up, and does it take this namespace?)"
                )
            if not why:
                return rec.info()
            if time.monotonic() > deadline:
                raise NotReplicatedError(
                    f"{where} is committed, but not replicated within {timeout_s:g} s: {_say(why)}"
                )
            time.sleep(POLL_S)

    def _ask(self, node: str, namespace: str, step: int) -> str | None:
        """Why ``node``'s share is not replicated yet (None: it is)."""
        try:
            held = self.client.inventory(node, namespace)
        except TierCkptError as e:
            return f"not answering ({e})"
        found: NodeStep | None = next((s for s in held if s.step == step), None)
        if found is None:
            return "not holding it committed yet"
        return _short(found.replication_pending, found.replicated_to)


def _short(pending: bool, replicated_to: list[str]) -> str | None:
    if pending:
        return "replication under way"
    if not replicated_to:
        return "no replica: its replication ended without one"
    return None


def _nodes(rec: StepRecord) -> list[str]:
    """The nodes holding a share of ``rec``'s step (this one only, for a step of one node)."""
    ring = rec.ring
    if ring is None or not ring.has_table:
        return [rec.coordinator] if rec.coordinator else []
    return sorted(ring.table)


def _say(why: dict[str, str]) -> str:
    return "; ".join(f"{node}: {what}" for node, what in sorted(why.items()))
