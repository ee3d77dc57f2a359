"""What every node of the ring holds (``tierckpt ls --cluster``): this daemon's own steps, and each
peer's, asked over the peer API in parallel.

The answer is bounded in time: each peer gets ``timeout_s`` (one try, no retry), and a peer that has
not answered by then (down, partitioned, stopped, or slow to resolve by DNS) is listed as
unreachable with the reason. A listing never waits longer than about ``timeout_s`` for the slowest
peer; its call keeps running in the background until the peer client's own timeout ends it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

from tierckpt_core.errors import TierCkptError
from tierckpt_core.protocol import ClusterListing, NodeListing, NodeStep, validate_namespace
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Membership
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

MAX_TIMEOUT_S = 60.0
MAX_PEERS_ASKED = 16  # peers asked at once


def inventory(service: TierService, namespace: str | None = None) -> list[NodeStep]:
    """The committed steps this daemon holds in memory (of ``namespace``, or of every one)."""
    if namespace is not None:
        validate_namespace(namespace)
    recs = service.committed_records(namespace)
    return [
        NodeStep(
            namespace=r.namespace,
            step=r.step,
            state=r.state,
            bytes=r.bytes,
            files=len(r.files),
            committed_at=r.committed_at,
            origin=r.origin,
            replicated_to=list(r.replicated_to),
            replication_pending=r.replication_pending,
            coordinator=r.coordinator,
        )
        for r in sorted(recs, key=lambda r: (r.namespace, r.step))
    ]


class ClusterLister:
    """Asks this node's peers what they hold (the membership and client of replication)."""

    def __init__(
        self, service: TierService, membership: Membership, client: PeerClient, *, node: str
    ) -> None:
        self.service = service
        self.membership = membership
        self.client = client
        self.node = node

    def listing(self, namespace: str | None, timeout_s: float) -> ClusterListing:
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(
                f"timeout must be in (0, {MAX_TIMEOUT_S:.0f}] seconds, got {timeout_s}"
            )
        own = NodeListing(node=self.node, reachable=True, steps=inventory(self.service, namespace))
        deadline = time.monotonic() + timeout_s
        pool = concurrent.futures.ThreadPoolExecutor(MAX_PEERS_ASKED, "tierckpt-cluster-ls")
        try:
            peers = self._members(pool, timeout_s)
            if isinstance(peers, NodeListing):  # membership itself could not be resolved
                return ClusterListing(node=self.node, timeout_s=timeout_s, nodes=[own, peers])
            asked = {
                peer: pool.submit(self.client.inventory, peer, namespace, timeout_s=timeout_s)
                for peer in peers
            }
            concurrent.futures.wait(asked.values(), timeout=max(0.0, deadline - time.monotonic()))
            nodes = [own] + [self._answer(peer, fut, timeout_s) for peer, fut in asked.items()]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        return ClusterListing(
            node=self.node, timeout_s=timeout_s, nodes=sorted(nodes, key=lambda n: n.node)
        )

    def _members(
        self, pool: concurrent.futures.Executor, timeout_s: float
    ) -> list[str] | NodeListing:
        """The other members of the ring (DNS resolved within ``timeout_s``), or why not."""
        fut = pool.submit(self.membership.members)
        try:
            members = fut.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            error = f"resolving the peers ({self.membership.describe()}) took over {timeout_s}s"
        except TierCkptError as e:
            error = str(e)
        else:
            return sorted(set(members) - {self.node})
        return NodeListing(node=self.membership.describe(), reachable=False, error=error)

    def _answer(
        self, peer: str, fut: concurrent.futures.Future[list[NodeStep]], timeout_s: float
    ) -> NodeListing:
        if not fut.done():
            fut.cancel()
            return NodeListing(node=peer, reachable=False, error=f"no answer within {timeout_s:g}s")
        try:
            steps = fut.result()
        except (TierCkptError, OSError) as e:
            logger.info("listing the cluster: peer %s: %s", peer, e)
            return NodeListing(node=peer, reachable=False, error=str(e))
        return NodeListing(node=peer, reachable=True, steps=steps)
