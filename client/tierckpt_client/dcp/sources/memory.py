"""This node's memory tier, through its daemon: the step's files pinned while they are read.

Of a step spanning nodes, the files other nodes hold that this rank needs are read from those
nodes straight into the tensors when it needs them in bulk (``peers.PeerSource``, if the daemon
hands over connections), else brought whole into this node's memory first; when the rank needs
only a little of one (a replicated scalar written by a rank on another node), just those ranges,
fetched in blocks the daemon verifies.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_client.dcp.sources.base import StepFiles
from tierckpt_client.dcp.sources.files import LocalFiles
from tierckpt_client.dcp.sources.peers import PeerSource
from tierckpt_core.errors import NotFoundError, TierCkptError

logger = logging.getLogger(__name__)

# A rank that needs at most this much of a file another node holds fetches just those ranges.
RANGED_READ_MAX = 4 << 20


class MemorySource:
    """A :class:`~tierckpt_client.dcp.sources.base.Source` on this node's memory tier.

    ``peers``: read the files of a step spanning nodes that other nodes hold, and this rank needs
    in bulk, from those nodes straight into the tensors (:attr:`read_peers` says whether the last
    ``open_files`` did); else the daemon brings them here first."""

    filling: threading.Thread | None = None  # already in memory: nothing to bring

    def __init__(self, daemon: DaemonClient, config: ClientConfig, *, peers: bool) -> None:
        self.daemon = daemon
        self.config = config
        self.peers = peers
        self.read_peers = False

    def without_peers(self) -> MemorySource:
        """The same tier, every file brought into this node's memory by the daemon."""
        return MemorySource(self.daemon, self.config, peers=False)

    def metadata(self, namespace: str, step: int) -> dict[str, Any]:
        return self.daemon.metadata(namespace, step)

    @contextlib.contextmanager
    def open_files(self, namespace: str, step: int, refs: list[ShardRef]) -> Iterator[StepFiles]:
        daemon = self.daemon
        needed = {ref.file for ref in refs}
        try:
            pin = daemon.pin(namespace, step)
        except NotFoundError:  # evicted since read_metadata, or another node: bring it back
            daemon.hydrate(namespace, step)
            pin = daemon.pin(namespace, step)
        fetched = needed - set(pin.paths)
        wants: dict[str, list[tuple[int, int]]] = {}
        for ref in refs:
            if ref.file in fetched:
                wants.setdefault(ref.file, []).append((ref.offset, ref.length))
        whole = {n for n, r in wants.items() if sum(length for _, length in r) > RANGED_READ_MAX}
        remote = None
        if whole and self.peers and self.config.reads_peers_direct():
            remote = PeerSource.offered(daemon, self.config, namespace, step)
        self.read_peers = remote is not None
        if remote is not None:
            logger.info(
                "%s/step %d: reading %s, held by other nodes, from them straight into the tensors",
                namespace,
                step,
                ", ".join(sorted(whole)[:8]),
            )
        if whole and remote is None:  # needed in bulk: the daemon brings them here first
            daemon.unpin(namespace, step, pin.pin_id)
            daemon.hydrate(namespace, step, sorted(whole))
            pin = daemon.pin(namespace, step)
        ranged: dict[str, dict[tuple[int, int], bytes]] = {}
        for name, ranges in wants.items():
            if name in whole:
                continue
            unique = sorted(set(ranges))
            data = daemon.read_ranges(namespace, step, name, unique)
            parts, at = {}, 0
            for off, length in unique:
                parts[(off, length)] = data[at : at + length]
                at += length
            ranged[name] = parts

        def mapped(name: str) -> torch.Tensor:
            return _arena.map_file(pin.paths[name]).buffer

        where = f"{namespace}/step {step}"
        local = LocalFiles(
            where,
            mapped,
            pin.paths,
            ranged,
            records={f.name: f for f in pin.step.files if f.name in pin.paths},
            verify_tensors=self.config.verify_reads,
        )
        # Needed in bulk and held elsewhere: from the nodes that hold them, into the tensors.
        files: StepFiles = local if remote is None else remote.files(where, whole, local)
        files.fetched = fetched
        try:
            yield files
        finally:
            files.close()
            try:
                daemon.unpin(namespace, step, pin.pin_id)
            except TierCkptError as e:
                logger.warning(
                    "%s/step %d: could not unpin: %s (it expires by itself)", namespace, step, e
                )
