"""The shares of a step spanning nodes as other nodes hold them: who holds each share (asked
through the step's ring record, not of every member), and a share's full file records fetched
from a holder and checked against the share's digest (see :class:`tierckpt_core.manifest.Share`).

A field of :class:`~tierckpt_daemon.peers.fetch.PeerFetcher`: it asks peers through the fetcher's
listings (a callback), finds where replicas went on the :class:`~.membership.Ring`, and takes
share tables from the fetcher's :class:`~.ring_table.RingTables`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from tierckpt_core.errors import (
    CheckpointFormatError,
    NotFoundError,
    PeerUnavailableError,
    StepNotFoundError,
    TierCkptError,
)
from tierckpt_core.manifest import FileRecord, RingRecord, StepManifest, ring_of, share_digest
from tierckpt_core.protocol import PeerStep
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Ring, successors
from tierckpt_daemon.peers.ring_table import RingTables
from tierckpt_daemon.tier.ownership import owned_by
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

SHARE_CACHE = 64  # other nodes' shares (full file records) kept after a fetch


Listings = Callable[[str, list[str]], dict[str, list[PeerStep]]]
"""``listings(namespace, peers)``: each answering peer's committed steps of ``namespace``."""


class Shares:
    def __init__(
        self,
        service: TierService,
        client: PeerClient,
        ring: Ring,
        tables: RingTables,
        listings: Listings,
    ) -> None:
        self.service = service
        self.client = client
        self.ring = ring
        self.tables = tables
        self._listings = listings
        # Full records of other nodes' shares, fetched and checked against RingRecord.shares.
        self._shares: OrderedDict[tuple[str, int, str, str], dict[str, FileRecord]] = OrderedDict()
        self._shares_lock = threading.Lock()

    def holders(
        self,
        namespace: str,
        step: int,
        ring: RingRecord,
        *,
        have: set[str] | frozenset[str] = frozenset(),
        nodes: list[str] | None = None,
        owner: str | None = None,
    ) -> dict[str, set[str] | None]:
        """Peers that hold the shares of a step spanning nodes, and which of its files (None:
        all of them): :meth:`copies`'s answer."""
        return {
            p: set(c.held) if c.held is not None else None
            for p, c in self.copies(
                namespace, step, ring, have=have, nodes=nodes, owner=owner
            ).items()
        }

    def copies(
        self,
        namespace: str,
        step: int,
        ring: RingRecord,
        *,
        have: set[str] | frozenset[str] = frozenset(),
        nodes: list[str] | None = None,
        owner: str | None = None,
    ) -> dict[str, PeerStep]:
        """The copies peers hold of a step spanning nodes (of ``nodes``' shares; default every
        share), found through its ring record rather than by asking every member: each share's
        node first; for a share those do not hold whole (its node lost, replaced, not
        answering), the members after its node in ring order, where its replicas went; only
        for a share none of those holds, every other member. ``have``: the files this node
        holds itself (they count as found)."""
        try:
            others = self.ring.successors()
        except PeerUnavailableError as e:
            logger.warning("%s/step %d: cannot ask the peers: %s", namespace, step, e)
            return {}
        me = self.ring.node
        table = self.tables.table(namespace, step, ring).table
        asked_for = table if nodes is None else {n: table[n] for n in nodes if n in table}
        wanted = {n: set(s.names) for n, s in asked_for.items()}
        found: dict[str, PeerStep] = {}
        asked = {me}

        def ask(peers: list[str]) -> None:
            new = [p for p in dict.fromkeys(peers) if p not in asked and p in others]
            asked.update(new)
            for peer, steps in self._listings(namespace, new).items():
                for s in steps:
                    if s.step == step and owned_by(s.owner, owner):
                        found[peer] = s

        def short() -> list[str]:
            held = set(have)
            for c in found.values():
                if c.held is None:
                    return []
                held |= set(c.held)
            return [n for n, names in sorted(wanted.items()) if not names <= held]

        ask(sorted(wanted))
        k = max(1, self.ring.replicas) + 1
        if missing := short():
            ask([p for n in missing for p in successors([*others, me], n)[:k]])
        if missing := short():
            logger.info(
                "%s/step %d: the shares of %s are neither on their nodes nor on the nodes after "
                "them; asking every other member",
                namespace,
                step,
                ", ".join(missing[:8]),
            )
            ask(others)
        return found

    def records(
        self, namespace: str, step: int, node: str, ring: RingRecord
    ) -> dict[str, FileRecord]:
        """The full records (block checksums, segments) of ``node``'s share of a step spanning
        nodes, which the global record leaves with the files (the share table: names and a
        digest): from ``node`` itself, else a peer holding a replica of them, each answer
        checked against the share's digest. Never a record that does not match it."""
        where = f"{namespace}/step {step}: the records of {node}'s share"
        ring = self.tables.table(namespace, step, ring)
        share = ring.table.get(node)
        if share is None:
            raise CheckpointFormatError(f"{where}: the step's record has no digest for them")
        names = set(share.names)
        key = (namespace, step, node, share.digest)
        with self._shares_lock:
            if key in self._shares:
                self._shares.move_to_end(key)
                return self._shares[key]
        held = self.holders(namespace, step, ring, nodes=[node])
        peers = [node] if node in held else []
        peers += [p for p, h in held.items() if p != node and (h is None or names <= h)]
        errors: list[str] = []
        for peer in peers:
            try:
                theirs = self.client.manifest(peer, namespace, step, metadata=False)
            except TierCkptError as e:
                errors.append(f"{peer}: {e}")
                continue
            found = [f for f in theirs.files if f.name in names and f.node == node and not f.slim]
            if {f.name for f in found} != names:
                errors.append(f"{peer} does not hold them")
                continue
            if share_digest(found) != share.digest:
                self.service.metrics.verification_failures.labels(tier="peer").inc()
                errors.append(f"{peer}: they do not match the step's digest of them")
                continue
            records = {f.name: f.model_copy(update={"size": None}) for f in found}
            with self._shares_lock:
                self._shares[key] = records
                while len(self._shares) > SHARE_CACHE:
                    self._shares.popitem(last=False)
            return records
        raise StepNotFoundError(
            f"{where} (block checksums) could not be had: {'; '.join(errors) or 'no peer holds it'}"
        )

    def complete(self, manifest: StepManifest) -> StepManifest:
        """``manifest`` (a peer's record of a step) with every file's full record, from the
        holders of its share (a reader on this node reads them from the peers, verified block by
        block); StepNotFoundError names the shares whose records no holder could send."""
        ring = ring_of(manifest)
        if ring is None:
            return manifest
        ring = self.tables.table(manifest.namespace, manifest.step, ring)
        files = {f.name: f for f in manifest.files if not f.slim}
        try:  # the files held here: their full records are this node's own
            here = self.service.record(manifest.namespace, manifest.step)
        except NotFoundError:
            here = None
        if here is not None and here.attempt == manifest.attempt:
            for name, f in here.files.items():
                files.setdefault(name, f.model_copy(update={"size": None}))
        missing: list[str] = []
        for node, share in sorted(ring.table.items()):
            if set(share.names) <= set(files):
                continue
            try:
                full = self.records(manifest.namespace, manifest.step, node, ring)
            except TierCkptError as e:
                missing.append(str(e))
                continue
            files.update(full)
        if missing:  # a reader cannot verify what it would read of those shares
            raise StepNotFoundError("; ".join(missing))
        return manifest.model_copy(
            update={"files": sorted(files.values(), key=lambda f: f.name), "ring": ring}
        )
