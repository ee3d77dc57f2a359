"""Where a reader's step comes from, in order: this node's memory, a peer that holds a replica,
the persistent tier; and which steps "latest" may pick from across those tiers.

The sources are small Protocols, so this module knows neither the uploader nor the replicator
(they fill the memory tier through :func:`tierckpt_daemon.tier.hydration.fill_step`); the daemon's
wiring (:mod:`tierckpt_daemon.node`) hands them in.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from typing import Protocol

from tierckpt_core.errors import (
    CheckpointFormatError,
    NamespaceNotFoundError,
    NotFoundError,
    PersistentTierError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
)
from tierckpt_core.manifest import RingRecord, StepManifest, metadata_digest, ring_of
from tierckpt_core.protocol import (
    PeerStep,
    StepCandidate,
    StepInfo,
    StepState,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.locks import KeyedLocks
from tierckpt_daemon.tier.ownership import owned_by
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

METADATA_CACHE_STEPS = 4  # steps whose metadata, fetched from its holders, is kept in memory


class PeerSource(Protocol):
    """Peers' copies; ``owner``: only that identity's steps count (None: anyone's)."""

    def peer_steps(self, namespace: str, *, owner: str | None = None) -> dict[int, list[str]]:
        """Which peers hold which committed steps (unreachable peers skipped, never waited on)."""
        ...

    def hydrate(
        self,
        namespace: str,
        step: int,
        files: set[str] | None = None,
        *,
        owner: str | None = None,
    ) -> StepInfo:
        """Copy a step (of a step spanning nodes: ``files``, default this node's share) from
        peers into memory, verified; NotFoundError if no peer holds it, CheckpointFormatError if
        every replica found was corrupt."""
        ...

    def holders(
        self, namespace: str, step: int, *, owner: str | None = None
    ) -> dict[str, set[str] | None]:
        """Peers that hold the step, and which of its files (None: all)."""
        ...

    def share_holders(
        self,
        namespace: str,
        step: int,
        ring: RingRecord,
        *,
        have: set[str] | frozenset[str] = frozenset(),
        nodes: list[str] | None = None,
        owner: str | None = None,
    ) -> dict[str, set[str] | None]:
        """Of a step spanning nodes, the peers that hold its shares (``nodes``'; default all)
        and which files, asking the nodes its ring record names, not every peer."""
        ...

    def copies(self, namespace: str, step: int, *, owner: str | None = None) -> dict[str, PeerStep]:
        """The copies of the step that peers hold (attempt id, files held)."""
        ...

    def manifest_from(self, peer: str, namespace: str, step: int) -> StepManifest: ...

    def ring_table(self, namespace: str, step: int, ring: RingRecord) -> RingRecord:
        """``ring`` with its share table (fetched from the step's holders, else the persistent
        tier, checked against its digest, cached); StepNotFoundError if none could be had."""
        ...

    def remember_table(self, namespace: str, step: int, ring: RingRecord | None) -> None:
        """Keep the share table of a holder's record fetched for its metadata."""
        ...

    def complete(self, manifest: StepManifest) -> StepManifest:
        """``manifest`` with the full records of other nodes' files (from their holders)."""
        ...

    def read_ranges(
        self, node: str, name: str, namespace: str, step: int, ranges: list[tuple[int, int]]
    ) -> bytes:
        """Parts of file ``name`` of ``node``'s share, verified against its block checksums."""
        ...


class DurableSource(Protocol):
    def durable_steps(self, namespace: str) -> list[int]: ...

    def manifest(self, namespace: str, step: int) -> StepManifest:
        """The manifest of a durable step (NotFoundError if it is not durable)."""
        ...

    def hydrate(
        self, namespace: str, step: int, files: set[str] | None = None, *, owner: str | None = None
    ) -> StepInfo:
        """Bring a durable step (of a step spanning nodes: ``files``, default this node's share)
        into memory, verified; NamespaceOwnerError if it is not ``owner``'s."""
        ...


class Restorer:
    def __init__(
        self,
        service: TierService,
        *,
        peers: PeerSource | None = None,
        durable: DurableSource | None = None,
    ) -> None:
        self.service = service
        self.peers = peers
        self.durable = durable
        self._guard = threading.Lock()
        self._locks = KeyedLocks()  # one hydration per step at a time
        # DCP metadata fetched from its holders (steps spanning nodes), newest last.
        self._metadata: OrderedDict[tuple[str, int, str], str] = OrderedDict()
        self._metadata_locks = KeyedLocks()  # one fetch of a step's metadata at a time

    def metadata(self, namespace: str, step: int, *, owner: str | None = None) -> str:
        """The DCP metadata of a committed step held here. A step spanning nodes keeps it on its
        decider and the nodes after it (RingRecord): on any other node it comes from one of
        them, else from the persistent tier, checked against the digest in the step's record,
        and is cached (the last few steps)."""
        manifest = self.service.manifest(namespace, step, owner=owner)
        if not manifest.metadata_elsewhere:
            return manifest.metadata
        return self._fetch_metadata(manifest)

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
                if self.peers is not None:  # a holder's record has the share table too
                    self.peers.remember_table(namespace, step, m.ring)
                return m.metadata
            tried.append(f"{source}: its metadata does not match the step's digest")
            return None

        found: str | None = None
        for holder in ring.holders_for(self.service.node):
            if self.peers is None:
                continue
            try:
                found = fetched(holder, self.peers.manifest_from(holder, namespace, step))
            except TierCkptError as e:
                tried.append(f"{holder}: {e}")
            if found is not None:
                break
        if found is None and self.durable is not None:
            try:
                found = fetched("the persistent tier", self.durable.manifest(namespace, step))
            except TierCkptError as e:
                tried.append(f"the persistent tier: {e}")
        if found is None:
            raise StepNotFoundError(
                f"{where}: its DCP metadata is kept by {', '.join(ring.metadata_holders)}, and "
                f"no copy could be had ({'; '.join(tried) or 'no peers, no persistent tier'})"
            )
        return found

    def _table(self, namespace: str, step: int, ring: RingRecord) -> RingRecord:
        """``ring`` with its share table: kept here (a holder), else from the step's holders
        or the persistent tier, checked against its digest (StepNotFoundError if none)."""
        if ring.has_table:
            return ring
        if self.peers is not None:
            return self.peers.ring_table(namespace, step, ring)
        where = f"{namespace}/step {step}: its share table"
        if self.durable is None:
            raise StepNotFoundError(f"{where} is kept by its holders, and this daemon has no peers")
        try:
            theirs = ring_of(self.durable.manifest(namespace, step))
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
        share = self._table(rec.namespace, rec.step, rec.ring).table.get(me)
        return set(share.names) if share is not None else set()

    def candidates(self, namespace: str, *, owner: str | None = None) -> list[StepCandidate]:
        """Steps ``latest`` may pick, newest first: committed in memory, held by a peer, or
        durable; of peers' copies, only ``owner``'s (None: anyone's). Unreachable peers are
        skipped (with a warning), never waited for long."""
        validate_namespace(namespace)
        on_peers = self.peers.peer_steps(namespace, owner=owner) if self.peers is not None else {}
        in_memory = {r.step: r.state for r in self.service.records(namespace, owner=owner)}
        durable: set[int] = set()
        tier_error: PersistentTierError | None = None
        if self.durable is not None:
            try:
                durable = set(self.durable.durable_steps(namespace))
            except PersistentTierError as e:
                # A broken persistent tier must not take the memory tier down with it.
                logger.warning("%s: listing the persistent tier failed: %s", namespace, e)
                tier_error = e
        durable |= {s for s, state in in_memory.items() if state == StepState.DURABLE}
        steps = sorted(set(in_memory) | durable | set(on_peers), reverse=True)
        # "latest" must be whole: skip steps spanning nodes whose lost shares are nowhere.
        while (
            steps
            and steps[0] not in durable
            and self._lost(namespace, steps[0], owner, on_peers.get(steps[0], []))
        ):
            steps.pop(0)
        if not steps:
            if tier_error is not None:
                raise tier_error
            where = " or the persistent tier" if self.durable else ""
            where += ", nor do its peers hold one" if self.peers else ""
            raise NamespaceNotFoundError(
                f"namespace {namespace} has no committed step in memory{where}"
            )
        return [
            StepCandidate(
                step=s, in_memory=s in in_memory, durable=s in durable, peers=on_peers.get(s, [])
            )
            for s in steps
        ]

    def _lost(self, namespace: str, step: int, owner: str | None, known: list[str]) -> bool:
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
        elif self.peers is None:
            return False  # not here, and no peer to hold it: not a candidate of this node
        else:
            ring, names = None, set()
            sources = known or list(self.peers.holders(namespace, step, owner=owner))
            for peer in sources:
                try:
                    manifest = self.peers.manifest_from(peer, namespace, step)
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
            ring = self._table(namespace, step, ring)
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
            self.peers.share_holders(namespace, step, ring, have=names, owner=owner)
            if self.peers is not None
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

    def peer_sources(
        self, namespace: str, step: int, *, owner: str | None = None
    ) -> tuple[StepManifest, dict[str, PeerStep]]:
        """The manifest of a step the peers hold (from a peer that holds all of it, if one
        does), and the copies the peers hold (each its own attempt id, and which files): for a
        reader here to read it from them. StepNotFoundError if no reachable peer holds it."""
        validate_namespace(namespace)
        validate_step(step)
        if self.peers is None:
            raise StepNotFoundError(f"{namespace}/step {step}: this daemon has no peers")
        holders = self.peers.copies(namespace, step, owner=owner)
        errors = []
        for peer in sorted(holders, key=lambda p: holders[p].held is not None):
            try:
                manifest = self.peers.manifest_from(peer, namespace, step)
            except TierCkptError as e:
                errors.append(f"{peer}: {e}")
                continue
            if (manifest.namespace, manifest.step) == (namespace, step) and owned_by(
                manifest.owner, owner
            ):
                # A reader reads it from the peers: every file's block checksums, the metadata.
                manifest = self.peers.complete(manifest)
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
        ring = self._table(namespace, step, rec.ring) if rec.ring is not None else None
        node = ring.node_of(name) if ring is not None else None
        if node is None:
            raise StepNotFoundError(f"{namespace}/step {step} has no file {name}")
        if self.peers is None:
            raise StepNotFoundError(
                f"{namespace}/step {step}: {name} is held by {node}, and this daemon has no peers"
            )
        return self.peers.read_ranges(node, name, namespace, step, ranges)

    def hydrate(
        self,
        namespace: str,
        step: int,
        files: list[str] | None = None,
        *,
        owner: str | None = None,
    ) -> StepInfo:
        """Make a step available in memory (from peers and the persistent tier, ``owner``'s
        only): already here, else a verified copy from a peer that
        holds a replica, else from the persistent tier. Of a step spanning nodes, a node holds
        the files its ranks wrote; ``files`` names others this node's readers need, which come
        from the peers that hold them. Concurrent calls for one step (every rank of the node
        asks) wait for the first."""
        validate_namespace(namespace)
        validate_step(step)
        with self._locks.held((namespace, step)):
            try:
                rec = self.service.record(namespace, step, owner=owner)
            except NotFoundError as e:
                missing: NotFoundError = e
            else:
                named = set(files) if files is not None else self._own_share(rec)
                need = named - set(rec.files)
                if not need:
                    return rec.info()
                ring = self._table(namespace, step, rec.ring) if rec.ring is not None else None
                unknown = sorted(n for n in need if ring is None or ring.node_of(n) is None)
                if unknown:
                    raise StepNotFoundError(
                        f"{namespace}/step {step} has no file {', '.join(unknown[:8])}"
                    )
                return self._fetch(namespace, step, need, owner)
            wanted = set(files) if files else None
            if self.peers is not None:
                try:
                    return self.peers.hydrate(namespace, step, wanted, owner=owner)
                except NotFoundError as e:
                    missing = e
                except CheckpointFormatError as e:  # every replica failed verification
                    if self.durable is None:
                        raise
                    logger.warning(
                        "%s/step %d: no good replica on the peers (%s); trying the persistent tier",
                        namespace,
                        step,
                        e,
                    )
            if self.durable is None:
                raise missing
            return self.durable.hydrate(namespace, step, wanted, owner=owner)

    def _fetch(self, namespace: str, step: int, need: set[str], owner: str | None) -> StepInfo:
        """Files of a step spanning nodes that other nodes hold: from the peers that hold them,
        else from the persistent tier."""
        where = f"{namespace}/step {step}: {', '.join(sorted(need)[:8])}"
        if self.peers is not None:
            try:
                return self.peers.hydrate(namespace, step, need, owner=owner)
            except (NotFoundError, CheckpointFormatError) as e:
                if self.durable is None:
                    raise
                logger.warning("%s: not on the peers (%s); trying the persistent tier", where, e)
        if self.durable is None:
            raise StepNotFoundError(
                f"{where} are held by other nodes, and this daemon has no peers (TIERCKPT_PEERS) "
                "and no persistent tier"
            )
        return self.durable.hydrate(namespace, step, need, owner=owner)
