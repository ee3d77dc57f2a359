"""Replication to peers: push committed steps to the next k daemons on the ring, and bring a step
back from a peer's replica when this node lost it.

Pushes run in the daemon's background, never in the trainer. One worker takes committed steps in
commit order; each step's files stream in parallel (``TIERCKPT_REPLICATION_CONCURRENCY``) into a
pending replica on the peer, hashed on the way, and the peer checks every byte against the
checksums in the final commit. A successor that cannot be reached is skipped for the next one on
the ring, so k replicas still exist when k peers are up; a step short of replicas is retried with
backoff while newer steps go ahead. A step is held in memory until its replication is done or moot
(superseded, deleted or retired by retention), so losing this node right after a commit still
leaves the step on a peer.

Restores ask the ring successors first (where this node's replicas went) and verify every file
before the step is committed locally; a corrupt replica is skipped for the next source.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from tierckpt_core.errors import (
    CheckpointFormatError,
    ForbiddenError,
    IntegrityError,
    NotFoundError,
    PeerUnavailableError,
    ProtocolError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
    UnauthorizedError,
)
from tierckpt_core.integrity import block_digest
from tierckpt_core.layout import verify_file
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_core.protocol import (
    ReplicationStatus,
    StepInfo,
)
from tierckpt_daemon.background import QueueWorker, background_pool
from tierckpt_daemon.hydration import fill_step
from tierckpt_daemon.membership import Membership, successors
from tierckpt_daemon.peer_client import PeerClient
from tierckpt_daemon.records import StepRecord
from tierckpt_daemon.service import TierService

logger = logging.getLogger(__name__)

RETRY_BASE_S = 1.0
RETRY_MAX_S = 60.0

# Errors that make one peer a bad source or target for now; the next peer may do.
PEER_ERRORS = (
    PeerUnavailableError,
    UnauthorizedError,
    NotFoundError,
    StepStateError,
    ProtocolError,
    CheckpointFormatError,
)


class Replicator(QueueWorker[StepRecord]):
    """Pushes committed steps to ring successors (a commit listener of the service), answers
    peers' pulls, and restores steps from peers' replicas."""

    def __init__(
        self,
        service: TierService,
        membership: Membership,
        client: PeerClient,
        *,
        node: str,
        replicas: int = 1,
        concurrency: int = 4,
        nice: int = 0,
    ) -> None:
        super().__init__(
            "tierckpt-replicator", nice=nice, retry_base_s=RETRY_BASE_S, retry_max_s=RETRY_MAX_S
        )
        self.service = service
        self.membership = membership
        self.client = client
        self.node = node
        self.replicas = replicas
        self._pool = background_pool(concurrency, "tierckpt-push", nice)
        self._ask_pool = ThreadPoolExecutor(8, thread_name_prefix="tierckpt-peer-list")
        self._members: list[str] = [] if membership.dns else sorted(membership.static)
        self._unreachable: set[str] = set()
        self._last_error: str | None = None

    # -- life cycle -------------------------------------------------------------------------
    def start(self) -> None:
        for rec in self.service.pending_replications():
            logger.info("%s/step %d: resuming its replication", rec.namespace, rec.step)
            self.enqueue(rec)
        super().start()

    def committed(self, rec: StepRecord) -> None:
        """Commit listener: queue the step if it is to be replicated."""
        if rec.replication_pending:
            self.enqueue(rec)

    def persist_requested(self, rec: StepRecord) -> None:
        pass

    def stop(self) -> None:
        super().stop()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ask_pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    def status(self) -> ReplicationStatus:
        m = self.service.metrics
        with self._cv:
            members, unreachable, last_error = (
                list(self._members),
                sorted(self._unreachable),
                self._last_error,
            )
        return ReplicationStatus(
            node=self.node,
            peers=members,
            replicas=self.replicas,
            queued_steps=self.queued(),
            replicated_steps=m.total(m.replicated_steps),
            replicated_bytes=m.total(m.replicated_bytes),
            received_steps=m.total(m.replicas_received),
            failed_pushes=m.total(m.replication_failures),
            unreachable=unreachable,
            last_error=last_error,
        )

    # -- membership -------------------------------------------------------------------------
    def successors(self) -> list[str]:
        """The other members in ring order after this node (resolves DNS: call from a thread)."""
        members = self.membership.members()
        with self._cv:
            self._members = sorted(set(members) | {self.node})
        return successors(members, self.node)

    def _peer_failed(self, peer: str, error: TierCkptError | OSError) -> None:
        with self._cv:
            first = peer not in self._unreachable
            self._unreachable.add(peer)
        if first:  # once per outage, not once per retry
            logger.warning("peer %s: %s", peer, error)

    def _peer_ok(self, peer: str) -> None:
        with self._cv:
            was_down = peer in self._unreachable
            self._unreachable.discard(peer)
        if was_down:
            logger.info("peer %s answers again", peer)

    # -- pushes ---------------------------------------------------------------------------
    def _process(self, rec: StepRecord) -> bool:
        try:
            return self._replicate(rec)
        except Exception as e:  # say so in the status too, then let the worker retry the step
            self._record_failure(rec, f"{rec.namespace}/step {rec.step}: {e!r}")
            raise

    def _record_failure(self, rec: StepRecord, message: str) -> None:
        self.service.metrics.replication_failures.inc()
        with self._cv:
            self._last_error = message

    def _replicate(self, rec: StepRecord) -> bool:
        """Push ``rec`` until ``replicas`` successors hold it; False: retry later."""
        ns, step = rec.namespace, rec.step
        if not self.service.is_current(rec):  # superseded, deleted or retired meanwhile
            self.service.end_replication(rec)
            return True
        try:
            targets = self.successors()
        except PeerUnavailableError as e:
            self._record_failure(rec, f"{ns}/step {step}: {e}")
            logger.warning("%s", e)
            return False
        want = min(self.replicas, len(targets))
        have = [p for p in rec.replicated_to if p in targets]
        errors: list[str] = []
        for peer in targets:
            if len(have) >= want:
                break
            if peer in have:
                continue
            try:
                self._push(rec, peer)
            except (TierCkptError, OSError) as e:
                self._peer_failed(peer, e)
                errors.append(f"{peer}: {e}")
                continue
            self._peer_ok(peer)
            have.append(peer)
        if len(have) >= want:
            self.service.end_replication(rec)
            if errors:
                logger.info("%s/step %d replicated to %s instead", ns, step, ", ".join(have))
            with self._cv:
                self._last_error = None
            return True
        self._record_failure(
            rec,
            f"{ns}/step {step}: replicated to {len(have)} of {want} peers ({'; '.join(errors)}); "
            "retrying (the step stays in memory)",
        )
        return False

    def share(self, rec: StepRecord) -> list[FileRecord]:
        """What this node replicates of ``rec``: a step of its own, whole; of a step spanning
        nodes, the files its own ranks wrote (each node replicates its own share)."""
        files = rec.sorted_files()
        if rec.spans_nodes:
            files = [f for f in files if f.node == self.node]
        return files

    def _push(self, rec: StepRecord, peer: str) -> None:
        ns, step = rec.namespace, rec.step
        files = self.share(rec)
        if files and all(f.checksum for f in files):
            # Already there (e.g. the peer this step was restored from)? Then no bytes move.
            try:
                theirs = self.client.manifest(peer, ns, step)
            except NotFoundError:
                pass
            else:
                held = _held(theirs)
                if all(
                    f.name in held and (theirs.file(f.name) or f).checksum == f.checksum
                    for f in files
                ) and (rec.spans_nodes or len(theirs.files) == len(files)):
                    self.service.mark_replicated(rec, peer, {})
                    return
        t0 = time.monotonic()
        nbytes = sum(f.length for f in files)
        # The peer pulls: it fetches our manifest (with the files' checksums, computed now if no
        # upload did yet) and every file over the same fast path a restore uses, verifies them,
        # and commits the replica before it answers.
        info = self.client.pull(peer, ns, step, self.node, nbytes)
        # A share of a step spanning nodes may join the peer's own part of it (no origin there).
        if info.step != step or (info.origin != self.node and not rec.spans_nodes):
            raise ProtocolError(f"peer {peer} answered the pull of {ns}/step {step} with {info}")
        self.service.mark_replicated(rec, peer, {})
        self.service.metrics.replicated_bytes.inc(nbytes)
        self.service.metrics.replicated_steps.inc()
        dt = time.monotonic() - t0
        logger.info(
            "%s/step %d replicated to %s: %d files, %d bytes in %.2fs (%.0f MB/s)",
            ns,
            step,
            peer,
            len(files),
            nbytes,
            dt,
            nbytes / max(dt, 1e-9) / 1e6,
        )

    # -- restores ---------------------------------------------------------------------------
    def peer_steps(self, namespace: str) -> dict[int, list[str]]:
        """Which peers hold which committed steps of ``namespace``. Peers are asked in parallel,
        once each; one that does not answer within the peer timeout is skipped with a warning."""
        try:
            peers = self.successors()
        except PeerUnavailableError as e:
            logger.warning("%s: not asking the peers for steps: %s", namespace, e)
            return {}
        futures = {p: self._ask_pool.submit(self.client.list_steps, p, namespace) for p in peers}
        held: dict[int, list[str]] = {}
        for peer, fut in futures.items():
            try:
                steps = fut.result()
            except NotFoundError:
                continue
            except TierCkptError as e:
                self._peer_failed(peer, e)
                continue
            self._peer_ok(peer)
            for s in steps:
                held.setdefault(s.step, []).append(peer)
        return held

    def hydrate(self, namespace: str, step: int, files: set[str] | None = None) -> StepInfo:
        """Bring ``namespace/step`` here from the peers, verified. A step of one node comes whole
        from the first peer with a good replica (ring successors first); of a step spanning nodes
        only ``files`` come (default: this node's own share, what a replaced node lost), from the
        peers that hold them. StepNotFoundError if no peer holds it; IntegrityError if every
        replica found was corrupt."""
        with self.service.lock:
            here = self.service.index.committed.get(namespace, {}).get(step)
        if here is not None and here.spans_nodes:
            return self.fetch_files(namespace, step, set(files or ()) - set(here.files))[0]
        holders = self.holders(namespace, step)
        for peer in holders:
            try:
                manifest = self.client.manifest(peer, namespace, step)
            except TierCkptError as e:
                self._peer_failed(peer, e)
                continue
            if manifest.coordinator is None:
                break
            names = files if files is not None else {f.name for f in manifest.share(self.node)}
            return self.fetch_files(namespace, step, names)[0]
        return self._hydrate_whole(namespace, step)

    def _hydrate_whole(self, namespace: str, step: int) -> StepInfo:
        try:
            peers = self.successors()
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
                self._peer_failed(peer, e)
                unreachable.append(peer)
                continue
            t0 = time.monotonic()
            try:
                rec = self._copy_from(peer, manifest)
            except CheckpointFormatError as e:
                self.service.metrics.verification_failures.inc()
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
                self._peer_failed(peer, e)
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

    def holders(self, namespace: str, step: int) -> dict[str, set[str] | None]:
        """Peers that hold ``namespace/step``, and which of its files (None: all of them)."""
        try:
            peers = self.successors()
        except PeerUnavailableError as e:
            logger.warning("%s/step %d: cannot ask the peers: %s", namespace, step, e)
            return {}
        futures = {p: self._ask_pool.submit(self.client.list_steps, p, namespace) for p in peers}
        held: dict[str, set[str] | None] = {}
        for peer, fut in futures.items():
            try:
                steps = fut.result()
            except NotFoundError:
                continue
            except TierCkptError as e:
                self._peer_failed(peer, e)
                continue
            for s in steps:
                if s.step == step:
                    held[peer] = set(s.held) if s.held is not None else None
        return held

    def read_ranges(
        self, f: FileRecord, namespace: str, step: int, ranges: list[tuple[int, int]]
    ) -> bytes:
        """The ``ranges`` (offset, length) of file ``f`` of a step spanning nodes, which another
        node holds, concatenated: fetched from a peer that holds it (its writer's node first),
        verified before they leave this daemon. A small item the writing rank checksummed comes
        alone; anything else in whole blocks, each checked against the block checksums taken at
        prepare."""
        for off, n in ranges:
            if off < 0 or n < 0 or off + n > f.length:
                raise ProtocolError(f"{namespace}/step {step}: range {off}+{n} is outside {f.name}")
        held = self.holders(namespace, step)
        peers = sorted(
            (p for p, h in held.items() if h is None or f.name in h), key=lambda p: p != f.node
        )
        segments = {(off, n): digest for off, n, digest in f.segments or ()}
        parts: dict[tuple[int, int], bytes] = {}
        for off, n in ranges:
            if n and (off, n) in segments:
                parts[(off, n)] = self._fetch_verified(
                    peers, f, namespace, step, off, n, [segments[(off, n)]], n
                )
        rest = [(off, n) for off, n in ranges if n and (off, n) not in parts]
        if rest:
            size, digests = f.block_size, f.blocks
            if not size or digests is None:
                raise CheckpointFormatError(
                    f"{namespace}/step {step}: {f.name} has no block checksums to verify a range"
                )
            wanted = sorted(
                {b for off, n in rest for b in range(off // size, (off + n - 1) // size + 1)}
            )
            runs: list[list[int]] = []
            for b in wanted:
                if runs and runs[-1][-1] == b - 1:
                    runs[-1].append(b)
                else:
                    runs.append([b])
            blocks: dict[int, bytes] = {}
            for run in runs:
                start, end = run[0] * size, min((run[-1] + 1) * size, f.length)
                data = self._fetch_verified(
                    peers, f, namespace, step, start, end - start, [digests[b] for b in run], size
                )
                blocks.update({b: data[(b - run[0]) * size : (b - run[0] + 1) * size] for b in run})
            for off, n in rest:
                first = off // size
                buf = b"".join(blocks[b] for b in range(first, (off + n - 1) // size + 1))
                parts[(off, n)] = buf[off - first * size : off - first * size + n]
        return b"".join(parts.get((off, n), b"") for off, n in ranges)

    def _fetch_verified(
        self,
        peers: list[str],
        f: FileRecord,
        namespace: str,
        step: int,
        start: int,
        length: int,
        digests: list[str],
        piece: int,
    ) -> bytes:
        """``length`` bytes at ``start`` of ``f`` from the first peer whose bytes match
        ``digests``, one per ``piece`` bytes."""
        errors = []
        for peer in peers:
            try:
                data = self.client.read_range(peer, namespace, step, f.name, start, length)
            except PEER_ERRORS as e:
                errors.append(f"{peer}: {e}")
                continue
            pieces = [data[i : i + piece] for i in range(0, len(data), piece)]
            if [block_digest(p) for p in pieces] != digests:
                self.service.metrics.verification_failures.inc()
                errors.append(f"{peer}: bytes {start}-{start + length} of {f.name} are corrupt")
                continue
            self.service.metrics.peer_hydrated_bytes.inc(len(data))
            return data
        raise StepNotFoundError(
            f"{namespace}/step {step}: no peer could send {f.name} bytes {start}-{start + length} "
            f"({'; '.join(errors) or 'no peer holds it'})"
        )

    def manifest_from(self, peer: str, namespace: str, step: int) -> StepManifest:
        return self.client.manifest(peer, namespace, step)

    def fetch_files(self, namespace: str, step: int, names: set[str]) -> tuple[StepInfo, int]:
        """Bring the files ``names`` of a step spanning nodes here from the peers that hold them
        (their writer's node first), verified. Returns the step as held here and the bytes moved;
        StepNotFoundError names the files no reachable peer holds."""
        holders = self.holders(namespace, step)
        if not holders:
            raise StepNotFoundError(f"{namespace}/step {step}: no reachable peer holds it")
        if not names and not self.service.index.committed.get(namespace, {}).get(step):
            # Nothing to fetch, but this node needs the step's record (its metadata, where the
            # files are) to serve a reader: take it from a holder, with no files.
            peer = next(iter(holders))
            empty = self._copy_from(peer, self.client.manifest(peer, namespace, step), names=set())
            return empty.info(), 0
        left = set(names)
        moved = 0
        rec: StepRecord | None = None

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
                rec = self._copy_from(peer, theirs, names=offered)
            except PEER_ERRORS as e:
                self._peer_failed(peer, e)
                continue
            got = offered & set(rec.files)
            moved += sum(f.length for f in theirs.files if f.name in got)
            left -= got
        if left:
            raise StepNotFoundError(
                f"{namespace}/step {step}: no reachable peer holds {', '.join(sorted(left)[:8])}"
            )
        if rec is None:
            rec = self.service.record(namespace, step)
        self.service.metrics.peer_hydrated_bytes.inc(moved)
        return rec.info(), moved

    def pull_from(self, origin: str, namespace: str, step: int) -> StepInfo:
        """A peer's replication request: copy its committed ``namespace/step`` here, verified,
        as a replica whose origin is ``origin``. Only members of the ring are pulled from (the
        token goes with every request, so it must not go to an address a caller names)."""
        members = self.membership.members()
        if origin not in members or origin == self.node:
            raise ForbiddenError(
                f"{origin} is not a peer of this daemon ({self.node}); its members are "
                f"{', '.join(sorted(members)) or 'none'}"
            )
        manifest = self.client.manifest(origin, namespace, step)
        if (manifest.namespace, manifest.step) != (namespace, step):
            raise ProtocolError(f"peer {origin} answered for {manifest.namespace}/{manifest.step}")
        rec = self._copy_from(origin, manifest, replica=True)
        got = manifest.share(origin) if manifest.coordinator is not None else manifest.files
        self.service.metrics.replica_received_bytes.inc(sum(f.length for f in got))
        self.service.metrics.replicas_received.inc()
        return rec.info()

    def _copy_from(
        self,
        peer: str,
        manifest: StepManifest,
        *,
        replica: bool = False,
        names: set[str] | None = None,
    ) -> StepRecord:
        ns, step = manifest.namespace, manifest.step
        where = f"peer {peer}"
        attempt = manifest.attempt
        if attempt is None:
            raise ProtocolError(f"{where} sent a manifest of {ns}/step {step} with no attempt")
        spanning = manifest if manifest.coordinator is not None else None
        held = _held(manifest)
        files = [f for f in manifest.portable().files if f.name in held]
        if spanning is not None and replica:
            files = [f for f in files if f.node == peer]  # the peer's own share
        if names is not None:
            files = [f for f in files if f.name in names]
        unchecked = [f.name for f in files if not f.checksum]
        if unchecked:
            raise CheckpointFormatError(
                f"{where}: the manifest has no checksum for {', '.join(unchecked[:8])}"
            )

        def fetch(f: FileRecord, path: str) -> None:
            got = self.client.get_file(peer, ns, step, attempt, f.name, path, f.length)
            verify_file(got, f, ns, step, where)

        rec = fill_step(
            self.service,
            ns,
            step,
            files,
            metadata=manifest.metadata,
            world_size=manifest.world_size,
            fetch=fetch,
            pool=self._pool,
            attempt_prefix="r" if replica else "p",
            # A replica is not pushed on. A restored step is, cheaply: the peer it came from is
            # known to hold it (below).
            replicate=not replica,
            origin=peer if replica else None,
            spanning=spanning,
        )
        if not replica and spanning is None:
            self.service.mark_replicated(rec, peer, {})
        return rec


def _held(manifest: StepManifest) -> set[str]:
    """The files of ``manifest`` its sender holds (it says so for a step spanning nodes)."""
    if manifest.local is not None and manifest.local.held is not None:
        return set(manifest.local.held)
    return {f.name for f in manifest.files}
