"""A step (or some of its files) copied here from one peer, every byte verified as it lands:
the one copy path of a replica pulled by its origin's request, a step restored from a peer's
replica and the lost share of a step spanning nodes.

Used by the :class:`~tierckpt_daemon.peers.replication.Replicator` (a peer's pull) and the
:class:`~tierckpt_daemon.peers.fetch.PeerFetcher` (restores); it owns the pool the files stream
in on, closed by the daemon's :class:`~tierckpt_daemon.node.Node`.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from tierckpt_core.errors import CheckpointFormatError, ProtocolError
from tierckpt_core.layout import verify_file
from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.pacing import TokenBucket
from tierckpt_daemon.tier.background import background_pool
from tierckpt_daemon.tier.hydration import fill_step
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService


class Copier:
    def __init__(
        self,
        service: TierService,
        client: PeerClient,
        *,
        concurrency: int = 4,
        nice: int = 0,
        replication_pace: TokenBucket | None = None,
        fetch_pace: TokenBucket | None = None,
    ) -> None:
        self.service = service
        self.client = client
        self._pool: ThreadPoolExecutor = background_pool(concurrency, "tierckpt-push", nice)
        # Shared by every replica pulled here / every file a restore fetches (pacing.py).
        self.replication_pace = replication_pace
        self.fetch_pace = fetch_pace

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def copy_from(
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
        held = held_files(manifest)
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

        pace = self.replication_pace if replica else self.fetch_pace

        def fetch(f: FileRecord, path: str) -> None:
            if f.block_size and f.blocks is not None:
                # Several streams at once for a large file, each block checked as it arrives
                # against the writer's block checksums (taken with the whole-file one).
                self.client.get_file_blocks(
                    peer,
                    ns,
                    step,
                    attempt,
                    f.name,
                    path,
                    f.length,
                    f.block_size,
                    f.blocks,
                    pace=pace,
                )
                return
            got = self.client.get_file(peer, ns, step, attempt, f.name, path, f.length, pace=pace)
            verify_file(got, f, ns, step, where)

        rec = fill_step(
            self.service,
            ns,
            step,
            files,
            copy_of=manifest,
            fetch=fetch,
            pool=self._pool,
            attempt_prefix="r" if replica else "p",
            # A replica is not pushed on. A restored step is, cheaply: the peer it came from is
            # known to hold it (below).
            replicate=not replica,
            origin=peer if replica else None,
            spanning=spanning,
            hold=not replica,  # a restore is for a reader: retention must not take it back at once
            # Refused where the namespace is another owner's here, or where it would replace a
            # save of this node's own (ownership.py): checked before any byte moves.
            owner=manifest.owner,
        )
        if not replica and spanning is None:
            self.service.mark_replicated(rec, peer, {})
        return rec


def held_files(manifest: StepManifest) -> set[str]:
    """The files of ``manifest`` its sender holds (it says so for a step spanning nodes)."""
    if manifest.local is not None and manifest.local.held is not None:
        return set(manifest.local.held)
    return {f.name for f in manifest.files}
