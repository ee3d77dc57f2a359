"""This node's memory tier, through its daemon: the step's files pinned while they are read.

Of a step spanning nodes, the files other nodes hold that this rank needs are read from those
nodes straight into the tensors when it needs them in bulk (``peers.PeerSource``, if the daemon
hands over connections), else brought whole into this node's memory first; when the rank needs
only a little of one (a replicated scalar written by a rank on another node), just those ranges,
fetched in blocks the daemon verifies.

A load asks its daemon (``open_read``) for the step's metadata in ``read_metadata`` and for a pin
in ``read_data``, each a small answer: the step's metadata and file records (their block checksums
are most of a step's record) come only when this process does not hold those of this very commit
already. The pin is taken by ``read_data`` and its release sent before it returns, as before: a
load that fails, on any rank and in any phase, holds nothing. The release's answer is read at the
process's next request to a daemon (``DaemonClient.unpin(wait=False)``), not on the load's path.
For a step this process read before and unchanged since, ``read_metadata`` makes no request and
sends the pin ahead, for ``read_data`` to claim (``tierckpt_client._reads``); for any other, it
sends the pin ahead as soon as the metadata's answer is in (the daemon serves it while DCP plans);
one no load claims is released at the process's next request to a daemon, or when it exits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_client.dcp.sources.base import StepFiles
from tierckpt_client.dcp.sources.files import LocalFiles
from tierckpt_client.dcp.sources.peers import PeerSource
from tierckpt_core.errors import NotFoundError, ProtocolError, StepStateError, TierCkptError
from tierckpt_core.manifest import FileRecord
from tierckpt_core.protocol import ReadResponse

logger = logging.getLogger(__name__)

# A rank that needs at most this much of a file another node holds fetches just those ranges.
RANGED_READ_MAX = 4 << 20


@dataclass(frozen=True)
class _Known:
    """A step's metadata and file records (by name), as of one ``version`` of its commit."""

    version: str
    metadata: str  # as committed (tierckpt_core.metadata_blob)
    records: dict[str, FileRecord]


@dataclass(frozen=True)
class _Opened:
    """A step pinned for a load: its files' paths, and what it holds."""

    pin_id: str
    paths: dict[str, str]
    known: _Known


# What this process holds of the steps it loaded from a daemon's memory, by (socket, namespace,
# step): a load of a step read before gets only a pin (its records with their block checksums are
# most of the answer). A few: a job loads the newest step, and loads it again after a failure.
_KNOWN: OrderedDict[tuple[str, str, int], _Known] = OrderedDict()
_KNOWN_MAX = 8
_KNOWN_LOCK = threading.Lock()


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
        # The metadata this source answered read_metadata with, by (namespace, step).
        self._served: dict[tuple[str, int], str] = {}

    def without_peers(self) -> MemorySource:
        """The same tier, every file brought into this node's memory by the daemon."""
        return MemorySource(self.daemon, self.config, peers=False)

    def metadata(self, namespace: str, step: int) -> str:
        """The step's metadata (NotFoundError when it is not in this node's memory)."""
        doc = self._open(namespace, step, pin=False).known.metadata
        self._served[(namespace, step)] = doc
        return doc

    def _check_served(self, namespace: str, step: int, pin: _Opened) -> None:
        """The step pinned for the read is the one whose metadata DCP planned with: saved again
        in between (another layout, other offsets), it would be read at the wrong places."""
        served = self._served.get((namespace, step))
        if served is None or pin.known.metadata is served or pin.known.metadata == served:
            return  # (a record that gained block checksums is a new version of the same step)
        self._unpin(namespace, step, pin.pin_id)
        raise StepStateError(
            f"{namespace}/step {step} was saved again while it was being loaded (after DCP "
            "planned the load with its metadata); load it again"
        )

    def _open(self, namespace: str, step: int, *, pin: bool) -> _Opened:
        """The step (pinned if ``pin``): one round trip, with its metadata and records unless
        this process holds them already."""
        key = (str(self.config.socket), namespace, step)
        with _KNOWN_LOCK:
            known = _KNOWN.get(key)
        answer = self.daemon.open_read(namespace, step, known.version if known else None, pin=pin)
        if answer.metadata is not None and answer.files is not None:
            known = self.adopt(namespace, step, answer)
        elif known is None or known.version != answer.version:
            if answer.pin_id is not None:
                self._unpin(namespace, step, answer.pin_id)
            raise ProtocolError(
                f"{namespace}/step {step}: the daemon left out the step's metadata for a version "
                f"this process does not hold ({answer.version})"
            )
        return _Opened(answer.pin_id or "", answer.paths, known)

    def adopt(self, namespace: str, step: int, answer: ReadResponse) -> _Known:
        """Hold the step's metadata and file records as the daemon answered them (to this
        source's ``open_read``, or with the candidates of a load of "latest": its next
        ``open_read`` of this version then asks for neither)."""
        assert answer.metadata is not None and answer.files is not None
        key = (str(self.config.socket), namespace, step)
        known = _Known(answer.version, answer.metadata, {f.name: f for f in answer.files})
        with _KNOWN_LOCK:
            _KNOWN[key] = known
            _KNOWN.move_to_end(key)
            while len(_KNOWN) > _KNOWN_MAX:
                _KNOWN.popitem(last=False)
        return known

    def _unpin(self, namespace: str, step: int, pin_id: str, *, wait: bool = True) -> None:
        try:
            self.daemon.unpin(namespace, step, pin_id, wait=wait)
        except TierCkptError as e:
            logger.warning(
                "%s/step %d: could not unpin: %s (it expires by itself)", namespace, step, e
            )

    def _repinned(self, namespace: str, step: int, name: str, error: StepStateError) -> _Opened:
        """The step pinned again, now that the daemon holds ``name`` (which it did not when the
        load pinned it); ``error`` (the daemon's refusal to send it) if it still does not."""
        again = self._open(namespace, step, pin=True)
        if name not in again.paths:
            self._unpin(namespace, step, again.pin_id, wait=False)
            raise error
        self._check_served(namespace, step, again)
        return again

    @contextlib.contextmanager
    def open_files(self, namespace: str, step: int, refs: list[ShardRef]) -> Iterator[StepFiles]:
        daemon = self.daemon
        needed = {ref.file for ref in refs}
        try:
            pin = self._open(namespace, step, pin=True)
        except NotFoundError:  # evicted since read_metadata, or another node: bring it back
            daemon.hydrate(namespace, step)
            pin = self._open(namespace, step, pin=True)
        self._check_served(namespace, step, pin)
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
            pin = self._open(namespace, step, pin=True)
            self._check_served(namespace, step, pin)
        ranged: dict[str, dict[tuple[int, int], bytes]] = {}
        try:
            for name, ranges in wants.items():
                if name in whole:
                    continue
                unique = sorted(set(ranges))
                try:
                    data = daemon.read_ranges(namespace, step, name, unique)
                except StepStateError as e:
                    # Here since the pin (a replica, or another reader's fetch, landed in
                    # between): the daemon sends only what other nodes hold; read it pinned.
                    again = self._repinned(namespace, step, name, e)
                    self._unpin(namespace, step, pin.pin_id, wait=False)
                    pin = again
                    fetched.discard(name)
                    continue
                parts, at = {}, 0
                for off, length in unique:
                    parts[(off, length)] = data[at : at + length]
                    at += length
                ranged[name] = parts
        except BaseException:
            self._unpin(namespace, step, pin.pin_id, wait=False)
            raise

        def mapped(name: str) -> torch.Tensor:
            return _arena.map_file(pin.paths[name]).buffer

        where = f"{namespace}/step {step}"
        local = LocalFiles(
            where,
            mapped,
            pin.paths,
            ranged,
            records={n: f for n, f in pin.known.records.items() if n in pin.paths},
            verify_tensors=self.config.verify_reads,
            pin_memory=self.config.pin_memory,
        )
        # Needed in bulk and held elsewhere: from the nodes that hold them, into the tensors.
        files: StepFiles = local if remote is None else remote.files(where, whole, local)
        files.fetched = fetched
        try:
            yield files
        finally:
            files.close()
            # Off the load's path: sent now, its answer read at this process's next request.
            self._unpin(namespace, step, pin.pin_id, wait=False)
