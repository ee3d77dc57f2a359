"""Restores from peers: which peers hold a step (and which of its files), a whole step copied
from a peer's replica, the lost share of a step spanning nodes, and parts of files another node
holds, each verified before it is used.

Every read is for one owner (``owner``, see :mod:`tierckpt_daemon.tier.ownership`; None: anyone's):
peers' copies of another owner's steps count as not there.

The :class:`~tierckpt_daemon.peers.replication.Replicator` pushes; this module reads. Both use the
daemon's one :class:`~tierckpt_daemon.peers.membership.Ring` (where replicas went, which peers did
not answer lately) and :class:`~tierckpt_daemon.peers.copier.Copier` (a step copied, verified).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from tierckpt_core.errors import (
    CheckpointFormatError,
    IntegrityError,
    NotFoundError,
    PeerUnavailableError,
    ProtocolError,
    StepNotFoundError,
    TierCkptError,
)
from tierckpt_core.manifest import RingRecord, StepManifest, ring_of
from tierckpt_core.protocol import PeerStep, StepInfo
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.copier import Copier
from tierckpt_daemon.peers.membership import PEER_ERRORS, Ring
from tierckpt_daemon.peers.ring_table import DurableManifest, RingTables
from tierckpt_daemon.peers.shares import Shares
from tierckpt_daemon.tier.ownership import owned_by
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

LIST_WAIT_S = 3.0  # how long "latest" and a restore wait for peers to list their steps


class PeerFetcher:
    def __init__(
        self,
        service: TierService,
        client: PeerClient,
        ring: Ring,
        copier: Copier,
        *,
        durable: DurableManifest | None = None,
        list_wait_s: float = LIST_WAIT_S,
    ) -> None:
        self.service = service
        self.client = client
        self.ring = ring  # where replicas went, and which peers did not answer lately
        self.copier = copier
        self.tables = RingTables(service, client, durable=durable)
        self.shares = Shares(service, client, ring, self.tables, self._listings)
        self.list_wait_s = list_wait_s
        # One thread per peer that does not answer stays busy until the peer timeout: room for
        # several of those besides the peers that do.
        self._ask_pool = ThreadPoolExecutor(32, thread_name_prefix="tierckpt-peer-list")
        # Per peer, the last listing asked of it and when (monotonic): one still unanswered
        # after ``list_wait_s`` means the peer does not answer now, and it is not asked again
        # (nor waited for) until that request ends.
        self._asked: dict[str, tuple[Future[list[PeerStep]], float]] = {}
        self._asked_lock = threading.Lock()

    def close(self) -> None:
        self._ask_pool.shutdown(wait=False, cancel_futures=True)

    def peer_steps(
        self,
        namespace: str,
        *,
        owner: str | None = None,
        silent: list[str] | None = None,
        near_silent: list[str] | None = None,
    ) -> dict[int, list[str]]:
        """Which peers hold which committed steps of ``namespace`` (``owner``'s). The ring
        neighbours are asked first (the nodes after this one hold its replicas, and every
        participant of a step holds its record); every other peer only when no neighbour knows
        the namespace, so that "latest" costs O(replicas) requests, not one per node. Peers are
        asked in parallel, once each; one that does not answer within the peer timeout is
        skipped with a warning (and added to ``silent``; a ring neighbour, which may hold this
        node's replicas, to ``near_silent`` too)."""
        quiet: list[str] = []
        try:
            peers = self.ring.successors()
        except PeerUnavailableError as e:
            logger.warning("%s: not asking the peers for steps: %s", namespace, e)
            quiet.append(f"the ring ({e})")
            peers = []
        near = self.ring.neighbours(peers) if peers else []
        held = self._ask_steps(namespace, near, owner, quiet) if near else {}
        for out in (silent, near_silent):
            if out is not None:
                out += quiet
        rest = [p for p in peers if p not in near]
        if not held and rest:
            logger.info(
                "%s: no ring neighbour holds a step of it; asking the other %d peers",
                namespace,
                len(rest),
            )
            held = self._ask_steps(namespace, rest, owner, silent)
        return held

    def _ask_steps(
        self, namespace: str, peers: list[str], owner: str | None, silent: list[str] | None
    ) -> dict[int, list[str]]:
        held: dict[int, list[str]] = {}
        for peer, steps in self._listings(namespace, peers, silent).items():
            for s in steps:
                if owned_by(s.owner, owner):
                    held.setdefault(s.step, []).append(peer)
        return held

    def _listings(
        self, namespace: str, peers: list[str], unanswered: list[str] | None = None
    ) -> dict[str, list[PeerStep]]:
        """Each peer's committed steps of ``namespace``, asked in parallel (in ``peers``'
        order; a peer that does not know it, or does not answer within ``list_wait_s``, left
        out: the caller decides on what answered, and a WARNING names the peers that did
        not, also added to ``unanswered``). A peer still silent on an earlier request past that
        wait is not asked again."""
        now = time.monotonic()
        futures: dict[str, Future[list[PeerStep]]] = {}
        silent: list[str] = []
        with self._asked_lock:
            for p in peers:
                before = self._asked.get(p)
                if (
                    before is not None
                    and not before[0].done()
                    and now - before[1] > self.list_wait_s
                ):
                    silent.append(p)
                    continue
                futures[p] = self._ask_pool.submit(self.client.list_steps, p, namespace)
                self._asked[p] = (futures[p], now)
        concurrent.futures.wait(futures.values(), timeout=self.list_wait_s)
        listed: dict[str, list[PeerStep]] = {}
        for peer, fut in futures.items():
            if not fut.done():
                silent.append(peer)
                continue
            try:
                listed[peer] = fut.result()
            except NotFoundError:
                continue
            except TierCkptError as e:
                self.ring.peer_failed(peer, e)
                if unanswered is not None:
                    unanswered.append(f"{peer} ({e})")
                continue
            self.ring.peer_ok(peer)
        if silent:
            logger.warning(
                "%s: peers %s did not answer within %.1f s: deciding without them",
                namespace,
                ", ".join(sorted(silent)),
                self.list_wait_s,
            )
            for peer in silent:
                self.ring.peer_failed(
                    peer,
                    PeerUnavailableError(f"no answer to a listing within {self.list_wait_s} s"),
                )
            if unanswered is not None:
                unanswered += [f"{p} (no answer within {self.list_wait_s:.0f} s)" for p in silent]
        return {p: listed[p] for p in peers if p in listed}

    def hydrate(
        self,
        namespace: str,
        step: int,
        files: set[str] | None = None,
        *,
        owner: str | None = None,
    ) -> StepInfo:
        """Bring ``namespace/step`` here from the peers, verified. A step of one node comes whole
        from the first peer with a good replica (ring successors first); of a step spanning nodes
        only ``files`` come (default: this node's own share, what a replaced node lost), from the
        peers that hold them. StepNotFoundError if no peer holds it; IntegrityError if every
        replica found was corrupt."""
        here = self.service.committed_record(namespace, step)
        if here is not None and here.spans_nodes:
            need = set(files or ()) - set(here.files)
            return self.fetch_files(namespace, step, need, owner=owner, ring=here.ring)[0]
        # Its record from a ring neighbour that holds the step (every participant holds it),
        # else from any peer that does.
        holders = self.peer_steps(namespace, owner=owner).get(step) or list(
            self.holders(namespace, step, owner=owner)
        )
        for peer in holders:
            try:
                manifest = self.client.manifest(peer, namespace, step)
            except TierCkptError as e:
                self.ring.peer_failed(peer, e)
                continue
            if not owned_by(manifest.owner, owner):
                continue
            if manifest.coordinator is None:
                break
            ring = ring_of(manifest)
            if files is not None or ring is None:
                names = files or set()
            else:  # this node's own share (a replaced node's): named in the share table
                share = self.tables.table(namespace, step, ring).table.get(self.ring.node)
                names = set(share.names) if share is not None else set()
            return self.fetch_files(namespace, step, names, owner=owner, ring=ring)[0]
        return self._hydrate_whole(namespace, step, owner)

    def _hydrate_whole(self, namespace: str, step: int, owner: str | None) -> StepInfo:
        try:
            peers = self.ring.successors()
        except PeerUnavailableError as e:
            raise StepNotFoundError(f"{namespace}/step {step}: cannot ask the peers: {e}") from e
        corrupt: list[str] = []
        unreachable: list[str] = []
        for peer in peers:
            try:
                manifest = self.client.manifest(peer, namespace, step)
                if (manifest.namespace, manifest.step) != (namespace, step):
                    raise ProtocolError(
                        f"peer {peer} answered for {manifest.namespace}/step {manifest.step}"
                    )
            except NotFoundError:
                continue
            except TierCkptError as e:
                self.ring.peer_failed(peer, e)
                unreachable.append(peer)
                continue
            if not owned_by(manifest.owner, owner):
                continue  # another owner's step of the same name: not this caller's
            t0 = time.monotonic()
            try:
                rec = self.copier.copy_from(peer, manifest)
            except CheckpointFormatError as e:
                self.service.metrics.verification_failures.labels(tier="peer").inc()
                logger.warning(
                    "%s/step %d: the replica on peer %s is unusable, trying the next source: %s",
                    namespace,
                    step,
                    peer,
                    e,
                )
                corrupt.append(str(e))
                continue
            except PEER_ERRORS as e:
                self.ring.peer_failed(peer, e)
                unreachable.append(peer)
                continue
            nbytes = sum(f.length for f in manifest.files)
            self.service.metrics.peer_hydrated_bytes.inc(nbytes)
            dt = time.monotonic() - t0
            logger.info(
                "%s/step %d hydrated from peer %s: %d bytes in %.2fs (%.0f MB/s), checksums "
                "verified",
                namespace,
                step,
                peer,
                nbytes,
                dt,
                nbytes / max(dt, 1e-9) / 1e6,
            )
            return rec.info()
        if corrupt:
            raise IntegrityError("; ".join(corrupt))
        down = f" ({', '.join(unreachable)} did not answer)" if unreachable else ""
        raise StepNotFoundError(f"{namespace}/step {step}: no peer holds a replica{down}")

    def holders(
        self, namespace: str, step: int, *, owner: str | None = None
    ) -> dict[str, set[str] | None]:
        """Peers that hold ``namespace/step``, and which of its files (None: all of them)."""
        return {
            p: set(s.held) if s.held is not None else None
            for p, s in self.copies(namespace, step, owner=owner).items()
        }

    def copies(self, namespace: str, step: int, *, owner: str | None = None) -> dict[str, PeerStep]:
        """The copies of ``namespace/step`` that peers hold (each its own save attempt id, and
        which of the step's files), in ring order."""
        try:
            peers = self.ring.successors()
        except PeerUnavailableError as e:
            logger.warning("%s/step %d: cannot ask the peers: %s", namespace, step, e)
            return {}
        held: dict[str, PeerStep] = {}
        for peer, steps in self._listings(namespace, peers).items():
            for s in steps:
                if s.step == step and owned_by(s.owner, owner):
                    held[peer] = s
        return held

    def manifest_from(self, peer: str, namespace: str, step: int) -> StepManifest:
        return self.client.manifest(peer, namespace, step)

    def fetch_files(
        self,
        namespace: str,
        step: int,
        names: set[str],
        *,
        owner: str | None = None,
        ring: RingRecord | None = None,
    ) -> tuple[StepInfo, int]:
        """Bring the files ``names`` of a step spanning nodes here from the peers that hold them
        (their writer's node first), verified: of the step's ``ring`` record, the holders of
        those files' shares are asked, else every peer. Returns the step as held here and the
        bytes moved; StepNotFoundError names the files no reachable peer holds."""
        if ring is not None and names:
            ring = self.tables.table(namespace, step, ring)
            nodes = sorted({node for n in names if (node := ring.node_of(n)) is not None})
            holders = self.shares.holders(namespace, step, ring, nodes=nodes, owner=owner)
        else:
            holders = self.holders(namespace, step, owner=owner)
        if not holders:
            raise StepNotFoundError(f"{namespace}/step {step}: no reachable peer holds it")
        if not names and self.service.committed_record(namespace, step) is None:
            # Nothing to fetch, but this node needs the step's record (its metadata, where the
            # files are) to serve a reader: take it from a holder, with no files.
            peer = next(iter(holders))
            empty = self.copier.copy_from(
                peer, self.client.manifest(peer, namespace, step), names=set()
            )
            return empty.info(), 0
        left = set(names)
        moved = 0
        rec: StepRecord | None = None
        failed: dict[str, tuple[Exception, set[str]]] = {}  # holders whose copy failed: why, what

        def coverage(peer: str) -> int:
            held = holders[peer]
            return len(left if held is None else left & held)

        for peer in sorted(holders, key=coverage, reverse=True):
            held = holders[peer]
            offered = left if held is None else left & held
            if not offered:
                continue
            try:
                theirs = self.client.manifest(peer, namespace, step)
                rec = self.copier.copy_from(peer, theirs, names=offered)
            except PEER_ERRORS as e:
                self.ring.peer_failed(peer, e)
                if not isinstance(e, NotFoundError):  # (one that let it go holds it no more)
                    failed[peer] = (e, offered)
                continue
            got = offered & set(rec.files)
            moved += sum(f.length for f in theirs.files if f.name in got)
            left -= got
        # Only the holders of what is still missing are to blame (another may have sent theirs).
        blame = {p: e for p, (e, what) in failed.items() if what & left}
        if left:
            missing = ", ".join(sorted(left)[:8])
            if not blame:
                raise StepNotFoundError(
                    f"{namespace}/step {step}: no reachable peer holds {missing}"
                )
            # Held by peers whose copy failed: say why, not "no peer holds it".
            why = "; ".join(f"{p}: {e}" for p, e in sorted(blame.items()))
            text = (
                f"{namespace}/step {step}: {missing} could not be fetched from its holders ({why})"
            )
            if all(isinstance(e, CheckpointFormatError) for e in blame.values()):
                raise IntegrityError(text)  # every copy found was corrupt
            raise PeerUnavailableError(text)
        if rec is None:
            rec = self.service.record(namespace, step)
        self.service.metrics.peer_hydrated_bytes.inc(moved)
        return rec.info(), moved
