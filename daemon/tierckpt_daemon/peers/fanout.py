"""The shape of a commit's fan-out: the decider sends the prepare and the decision to at most
``fanout`` children, each of which relays them to its own subtree, split the same way. The
decider sends O(fanout) messages instead of one per node, and a message crosses O(log N) hops.

Splitting is deterministic and needs nothing but the list: a relay splits the subtree it was
handed exactly as the decider would have.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tierckpt_core.errors import ProtocolError, TierCkptError
from tierckpt_core.protocol import DecideRequest, PreparedShare, PrepareRequest
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.in_doubt import abandon_reason

logger = logging.getLogger(__name__)

FANOUT = 8  # children per node (TIERCKPT_COMMIT_FANOUT)


def split(nodes: list[str], fanout: int) -> list[tuple[str, list[str]]]:
    """``nodes`` as (child, its subtree): every node a child of its own when there are at most
    ``fanout``; else ``fanout`` contiguous groups of near-equal size, each led by its first."""
    if fanout < 2:
        raise ValueError(f"a commit's fan-out must be at least 2, not {fanout}")
    if len(nodes) <= fanout:
        return [(n, []) for n in nodes]
    size, extra = divmod(len(nodes), fanout)
    groups: list[tuple[str, list[str]]] = []
    i = 0
    for g in range(fanout):
        n = size + (1 if g < extra else 0)
        groups.append((nodes[i], nodes[i + 1 : i + n]))
        i += n
    return groups


def depth(n: int, fanout: int) -> int:
    """Hops from the decider to the farthest of ``n`` other nodes."""
    hops = 0
    while n > 0:
        hops += 1
        n = 0 if n <= fanout else -(-n // fanout) - 1
    return hops


class CommitTree:
    """Sends a commit's prepare and decision to children that relay them on. Each request's
    timeout covers the hops below it."""

    def __init__(
        self,
        client: PeerClient,
        fanout: int,
        tell_later: Callable[[str, DecideRequest], None],
        abandon: Callable[[str, DecideRequest, str, BaseException], None],
    ) -> None:
        split([], fanout)  # refuses a fan-out below 2
        self.client = client
        self.fanout = fanout
        self.tell_later = tell_later
        self.abandon = abandon
        # A request to a child waits on its whole subtree: a pool of its own.
        self._pool = ThreadPoolExecutor(16, thread_name_prefix="tierckpt-relay")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def prepare(
        self,
        namespace: str,
        step: int,
        attempt: str,
        base: PrepareRequest,
        shares: dict[str, list[str]],
    ) -> dict[str, PreparedShare]:
        """Prepare ``shares`` (node -> its files) through the tree: children in parallel, each
        relaying to its subtree. What each node prepared; a failure raises, with ``.node``."""
        children = split(sorted(shares), self.fanout)

        def one(child: str, subtree: list[str]) -> dict[str, PreparedShare]:
            prep = base.model_copy(
                update={"files": shares[child], "subtree": {n: shares[n] for n in subtree}}
            )
            hops = depth(len(subtree), self.fanout) + 1
            try:
                got = self.client.prepare(
                    child, namespace, step, attempt, prep, timeout_s=hops * self.client.timeout_s
                )
            except TierCkptError as e:
                e.node = child  # type: ignore[attr-defined]
                raise
            stray = sorted(set(got.subtree) - set(subtree))
            if stray:
                raise ProtocolError(f"{child} answered for nodes it was not asked to: {stray}")
            return {child: PreparedShare(files=got.files, share_digest=got.share_digest)} | dict(
                got.subtree
            )

        futures = [self._pool.submit(one, c, sub) for c, sub in children]
        concurrent.futures.wait(futures)
        prepared: dict[str, PreparedShare] = {}
        for fut in futures:
            prepared.update(fut.result())  # the first failure raises
        return prepared

    def deliver(self, sends: list[tuple[str, DecideRequest]]) -> None:
        """Send each decision (with the nodes it relays to), and wait for the answers at most
        one peer timeout: the step is committed already, and a save must not wait longer on a
        participant that does not answer. A send still under way then goes on in the
        background; one that fails is told again later (:meth:`_sent`)."""
        futures = []
        for node, d in sends:
            fut = self._pool.submit(self._decide_at, node, d)
            fut.add_done_callback(functools.partial(self._sent, node, d))
            futures.append((node, fut))
        _, late = concurrent.futures.wait([f for _, f in futures], timeout=self.client.timeout_s)
        if late:
            m = sends[0][1].manifest
            logger.warning(
                "%s/step %d is committed; %s did not answer the decision within %.0f s: it is "
                "delivered in the background",
                m.namespace,
                m.step,
                ", ".join(node for node, f in futures if f in late),
                self.client.timeout_s,
            )

    def _sent(
        self, node: str, decision: DecideRequest, fut: concurrent.futures.Future[None]
    ) -> None:
        """A decision's send ended: if it failed, told again later, or not at all when telling
        it again cannot change the answer."""
        if fut.cancelled():  # the daemon stops
            return
        error = fut.exception()
        if error is None:
            return
        reason = abandon_reason(error)
        if reason is not None:
            self.abandon(node, decision, reason, error)
            return
        m = decision.manifest
        logger.warning(
            "%s/step %d is committed; participant %s did not take the decision yet (%s): "
            "it is told again",
            m.namespace,
            m.step,
            node,
            error,
        )
        self.tell_later(node, decision)

    def _decide_at(self, node: str, decision: DecideRequest) -> None:
        hops = depth(len(decision.relay), self.fanout) + 1
        self.client.decide(node, decision, timeout_s=hops * self.client.timeout_s)

    def relay(self, req: DecideRequest) -> None:
        """A participant that took a decision passes it on to the nodes it relays to."""
        if not req.relay:
            return
        m = req.manifest
        strangers = sorted(set(req.relay) - set(m.nodes()) - {m.coordinator})
        if strangers:
            raise ProtocolError(
                f"{m.namespace}/step {m.step}: the decision asks to relay it to {strangers}, "
                "which hold no share of the step: refused"
            )
        plain = req.model_copy(update={"relay": []})
        self.deliver(
            [
                (child, plain.model_copy(update={"relay": subtree}))
                for child, subtree in split(sorted(req.relay), self.fanout)
            ]
        )
