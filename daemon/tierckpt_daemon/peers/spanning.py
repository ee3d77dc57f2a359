"""What a restore needs to know of a step spanning nodes, which only the ring can tell: its DCP
metadata (kept by its holders), its share table, which files of it a node should hold, whether
its lost shares are anywhere, its record and copies for a reader here, and ranges of a file
another node holds.

The memory tier's :class:`~tierckpt_daemon.tier.restore.Restorer` orders the tiers and asks
this (its ``RingSource``); with no peers configured (``fetcher`` None) the persistent tier's
manifest is the only other copy of a step's record.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from tierckpt_core.errors import (
    NotFoundError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
)
from tierckpt_core.manifest import RingRecord, StepManifest, metadata_digest, ring_of
from tierckpt_core.protocol import PeerStep, validate_namespace, validate_step
from tierckpt_daemon.locks import KeyedLocks
from tierckpt_daemon.peers.fetch import PeerFetcher
from tierckpt_daemon.peers.ranges import Ranges
from tierckpt_daemon.peers.ring_table import DurableManifest
from tierckpt_daemon.tier.ownership import owned_by
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

METADATA_CACHE_STEPS = 4  # steps whose metadata, fetched from its holders, is kept in memory


class SpanningReads:
    def __init__(
        self,
        service: TierService,
        *,
        fetcher: PeerFetcher | None = None,
        durable: DurableManifest | None = None,
    ) -> None:
        self.service = service
        self.fetcher = fetcher
        self.durable = durable
        self.ranges = (
            Ranges(service, fetcher.client, fetcher.tables, fetcher.shares)
            if fetcher is not None
            else None
        )
        self._guard = threading.Lock()
        # DCP metadata fetched from its holders (steps spanning nodes), newest last.
        self._metadata: OrderedDict[tuple[str, int, str], str] = OrderedDict()
        self._metadata_locks = KeyedLocks()  # one fetch of a step's metadata at a time

    def metadata(self, manifest: StepManifest) -> str:
        """The DCP metadata of a step spanning nodes whose record here leaves it to its
        holders (its decider and the nodes after it): from one of them, else from the
        persistent tier, checked against the digest in the step's record, and cached (the last
        few steps)."""
        return self._fetch_metadata(manifest)

    def missing(self, rec: StepRecord, files: list[str] | None) -> set[str]:
        """Of a step held here, the files to bring here for ``files`` (None: the files this
        node's ranks wrote); StepNotFoundError names files the step does not have."""
        named = set(files) if files is not None else self._own_share(rec)
        need = named - set(rec.files)
        if not need:
            return need
        ring = self.table(rec.namespace, rec.step, rec.ring) if rec.ring is not None else None
        unknown = sorted(n for n in need if ring is None or ring.node_of(n) is None)
        if unknown:
            raise StepNotFoundError(
                f"{rec.namespace}/step {rec.step} has no file {', '.join(unknown[:8])}"
            )
        return need

    def _fetch_metadata(self, manifest: StepManifest) -> str:
        namespace, step, ring = manifest.namespace, manifest.step, manifest.ring
        assert ring is not None
        key = (namespace, step, manifest.attempt or "")
        # The node's ranks all ask at the start of a load: one fetch.
        with self._metadata_locks.held((namespace, step)):
            with self._guard:
                if key in self._metadata:
                    self._metadata.move_to_end(key)
                    return self._metadata[key]
            found = self._fetch_metadata_once(manifest)
            with self._guard:
                self._metadata[key] = found
                while len(self._metadata) > METADATA_CACHE_STEPS:
                    self._metadata.popitem(last=False)
            return found

    def _fetch_metadata_once(self, manifest: StepManifest) -> str:
        namespace, step, ring = manifest.namespace, manifest.step, manifest.ring
        assert ring is not None
        where = f"{namespace}/step {step}"
        tried: list[str] = []

        def fetched(source: str, m: StepManifest) -> str | None:
            if metadata_digest(m.metadata) == ring.metadata_digest:
                if self.fetcher is not None:  # a holder's record has the share table too
                    self.fetcher.tables.remember(namespace, step, m.ring)
                return m.metadata
            tried.append(f"{source}: its metadata does not match the step's digest")
            return None

        found: str | None = None
        for holder in ring.holders_for(self.service.node):
            if self.fetcher is None:
                continue
            try:
                found = fetched(holder, self.fetcher.client.manifest(holder, namespace, step))
            except TierCkptError as e:
                tried.append(f"{holder}: {e}")
            if found is not None:
                break
        if found is None and self.durable is not None:
            try:
                found = fetched("the persistent tier", self.durable(namespace, step))
            except TierCkptError as e:
                tried.append(f"the persistent tier: {e}")
        if found is None:
            raise StepNotFoundError(
                f"{where}: its DCP metadata is kept by {', '.join(ring.metadata_holders)}, and "
                f"no copy could be had ({'; '.join(tried) or 'no peers, no persistent tier'})"
            )
        return found

    def table(self, namespace: str, step: int, ring: RingRecord) -> RingRecord:
        """``ring`` with its share table: kept here (a holder), else from the step's holders
        or the persistent tier, checked against its digest (StepNotFoundError if none)."""
        if ring.has_table:
            return ring
        if self.fetcher is not None:
            return self.fetcher.tables.table(namespace, step, ring)
        where = f"{namespace}/step {step}: its share table"
        if self.durable is None:
            raise StepNotFoundError(f"{where} is kept by its holders, and this daemon has no peers")
        try:
            theirs = ring_of(self.durable(namespace, step))
        except TierCkptError as e:
            raise StepNotFoundError(f"{where}: the persistent tier: {e}") from e
        if theirs is None:
            raise StepNotFoundError(f"{where}: the persistent tier's manifest has none")
        return ring.with_table(
            theirs, where=f"the persistent tier's manifest of {namespace}/step {step}"
        )

    def _own_share(self, rec: StepRecord) -> set[str]:
        """With no files named, the files of the step this node's ranks wrote: none to name for
        a step of one node, or when a file of its own is held (its share came whole); else
        (it holds only a replica of another node's share) its share in the step's table."""
        me = self.service.node
        if rec.ring is None or me is None or any(f.node == me for f in rec.files.values()):
            return set()
        share = self.table(rec.namespace, rec.step, rec.ring).table.get(me)
        return set(share.names) if share is not None else set()

    def lost(self, namespace: str, step: int, owner: str | None, known: list[str]) -> bool:
        """Whether ``step`` spans nodes and some of its files are on no reachable node (it says
        which, in a warning); a step of one node is whole wherever it is. Only the nodes its
        ring record names are asked (each share's node, then where its replicas went); every
        peer only when no record of the step can be had. ``known``: peers that hold it."""
        try:
            rec = self.service.record(namespace, step, owner=owner)
        except NotFoundError:
            rec = None
        if rec is not None:
            ring, names = rec.ring, set(rec.files)
        elif self.fetcher is None:
            return False  # not here, and no peer to hold it: not a candidate of this node
        else:
            ring, names = None, set()
            sources = known or list(self.fetcher.holders(namespace, step, owner=owner))
            for peer in sources:
                try:
                    manifest = self.fetcher.client.manifest(peer, namespace, step)
                except TierCkptError as e:
                    logger.warning(
                        "%s/step %d: cannot read its record from %s: %s", namespace, step, peer, e
                    )
                    continue
                if manifest.coordinator is None:
                    return False  # a step of one node: whole wherever it is
                ring = ring_of(manifest)
                break
            else:
                return bool(sources)  # held, but its record could not be read: not "latest"
        if ring is None:
            return False  # a step of one node: whole wherever it is
        try:
            ring = self.table(namespace, step, ring)
        except TierCkptError as e:
            logger.warning(
                '%s/step %d: cannot tell whether it is whole (%s); "latest" falls back to an '
                "older step",
                namespace,
                step,
                e,
            )
            return True
        holders = (
            self.fetcher.shares.holders(namespace, step, ring, have=names, owner=owner)
            if self.fetcher is not None
            else {}
        )
        everything = ring.names()
        for held in holders.values():
            names |= everything if held is None else held
        lost = sorted(everything - names)
        if lost:
            nodes = sorted({ring.node_of(n) or "?" for n in lost})
            logger.warning(
                "%s/step %d is incomplete: %s (written on %s) are on no reachable node and not in "
                'the persistent tier; "latest" falls back to an older step',
                namespace,
                step,
                ", ".join(lost[:8]),
                ", ".join(nodes),
            )
        return bool(lost)

    def sources(
        self, namespace: str, step: int, *, owner: str | None = None
    ) -> tuple[StepManifest, dict[str, PeerStep]]:
        """The manifest of a step the peers hold (from a peer that holds all of it, if one
        does), and the copies the peers hold (each its own attempt id, and which files): for a
        reader here to read it from them. StepNotFoundError if no reachable peer holds it."""
        validate_namespace(namespace)
        validate_step(step)
        if self.fetcher is None:
            raise StepNotFoundError(f"{namespace}/step {step}: this daemon has no peers")
        holders = self.fetcher.copies(namespace, step, owner=owner)
        errors = []
        for peer in sorted(holders, key=lambda p: holders[p].held is not None):
            try:
                manifest = self.fetcher.client.manifest(peer, namespace, step)
            except TierCkptError as e:
                errors.append(f"{peer}: {e}")
                continue
            if (manifest.namespace, manifest.step) == (namespace, step) and owned_by(
                manifest.owner, owner
            ):
                # A reader reads it from the peers: every file's block checksums, the metadata.
                manifest = self.fetcher.shares.complete(manifest)
                if manifest.metadata_elsewhere:
                    metadata = self._fetch_metadata(manifest)
                    manifest = manifest.model_copy(update={"metadata": metadata})
                return manifest.portable(), holders
            errors.append(f"{peer} answered for {manifest.namespace}/step {manifest.step}")
        why = f" ({'; '.join(errors)})" if errors else ""
        raise StepNotFoundError(f"{namespace}/step {step}: no reachable peer holds it{why}")

    def read_ranges(
        self,
        namespace: str,
        step: int,
        name: str,
        ranges: list[tuple[int, int]],
        *,
        owner: str | None = None,
    ) -> bytes:
        """Parts of a file of a step spanning nodes that another node holds (a reader here needs
        a little of a big file: fetched in verified blocks, not whole)."""
        rec = self.service.record(namespace, step, owner=owner)
        if name in rec.files:
            raise StepStateError(f"{namespace}/step {step}: {name} is held here; pin and read it")
        ring = self.table(namespace, step, rec.ring) if rec.ring is not None else None
        node = ring.node_of(name) if ring is not None else None
        if node is None:
            raise StepNotFoundError(f"{namespace}/step {step} has no file {name}")
        if self.ranges is None:
            raise StepNotFoundError(
                f"{namespace}/step {step}: {name} is held by {node}, and this daemon has no peers"
            )
        return self.ranges.read(node, name, namespace, step, ranges)
