"""The share table of a step spanning nodes, kept once per ring: on the step's holders (its
decider and the next nodes, who also keep the DCP metadata) and in the persistent tier. Every
other node keeps only the table's digest (:class:`tierckpt_core.manifest.RingRecord`) and fetches
the table when it needs another node's share (a range of its file, a restore from the peers,
whether the newest step is whole), checked against that digest and cached.

:class:`RingTables` is a field of :class:`~tierckpt_daemon.peers.fetch.PeerFetcher`, shared with
its :class:`~tierckpt_daemon.peers.shares.Shares`; :func:`fetch_table` alone serves the in-doubt
resolver, which has no fetcher.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from tierckpt_core.errors import StepNotFoundError, TierCkptError
from tierckpt_core.manifest import RingRecord, StepManifest, ring_of
from tierckpt_daemon.locks import KeyedLocks
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.tier.service import TierService

TABLE_CACHE_STEPS = 8  # share tables fetched from their holders, kept in memory

DurableManifest = Callable[[str, int], StepManifest]


def fetch_table(
    client: PeerClient,
    node: str | None,
    namespace: str,
    step: int,
    ring: RingRecord,
    *,
    durable: DurableManifest | None = None,
) -> RingRecord:
    """``ring`` with its share table: from the first holder whose table matches ``ring``'s
    digest of it (their record without the DCP metadata), else from the persistent tier's
    manifest. StepNotFoundError says who was asked and why none would do."""
    if ring.has_table:
        return ring
    where = f"{namespace}/step {step}"
    tried: list[str] = []
    for holder in ring.holders_for(node):
        try:
            theirs = ring_of(client.manifest(holder, namespace, step, metadata=False))
            if theirs is None:
                tried.append(f"{holder}: its record of the step has no ring record")
                continue
            return ring.with_table(theirs, where=f"{holder}'s record of {where}")
        except TierCkptError as e:
            tried.append(f"{holder}: {e}")
    if durable is not None:
        try:
            theirs = ring_of(durable(namespace, step))
            if theirs is not None:
                return ring.with_table(theirs, where=f"the persistent tier's manifest of {where}")
            tried.append("the persistent tier: its manifest has no ring record")
        except TierCkptError as e:
            tried.append(f"the persistent tier: {e}")
    raise StepNotFoundError(
        f"{where}: its share table is kept by {', '.join(ring.metadata_holders)}, and no copy "
        f"could be had ({'; '.join(tried) or 'no peers, no persistent tier'})"
    )


class RingTables:
    """Share tables fetched from their holders (or the persistent tier), the last few kept."""

    def __init__(
        self, service: TierService, client: PeerClient, *, durable: DurableManifest | None = None
    ) -> None:
        self.service = service
        self.client = client
        # A durable step's manifest (the share table, when none of its holders answers).
        self.durable_manifest = durable
        self._tables: OrderedDict[tuple[str, int, str], RingRecord] = OrderedDict()
        self._tables_guard = threading.Lock()
        self._table_locks = KeyedLocks()

    def table(self, namespace: str, step: int, ring: RingRecord) -> RingRecord:
        """``ring`` with its share table: itself on a holder, else fetched (one fetch per step
        at a time on this node; the last few kept)."""
        if ring.has_table:
            return ring
        key = (namespace, step, ring.digest_of_table())
        with self._table_locks.held(key):
            with self._tables_guard:
                if key in self._tables:
                    self._tables.move_to_end(key)
                    return self._tables[key]
            full = fetch_table(
                self.client,
                self.service.node,
                namespace,
                step,
                ring,
                durable=self.durable_manifest,
            )
            self.remember(namespace, step, full)
            return full

    def remember(self, namespace: str, step: int, ring: RingRecord | None) -> None:
        """Keep the share table of a record fetched for another reason (the DCP metadata from a
        holder comes with it): a later need of the table takes it from here. Filed under its
        own digest, so only a record with that digest of its table finds it."""
        if ring is None or not ring.has_table:
            return
        key = (namespace, step, ring.digest_of_table())
        with self._tables_guard:
            self._tables[key] = ring
            self._tables.move_to_end(key)
            while len(self._tables) > TABLE_CACHE_STEPS:
                self._tables.popitem(last=False)
