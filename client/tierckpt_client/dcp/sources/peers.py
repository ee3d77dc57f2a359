"""A step that peers hold and this node lost, read from the peers straight into the destination
tensors, verified block by block as it lands; the daemon then brings it into this node's memory
in the background (see docs/design.md, "Restore straight from a peer").

Trainers talk to their own daemon only (no peer token, no TCP of their own: the chart's
NetworkPolicy lets only daemons reach each other). So the daemon dials the peer, sends the request
with its token and hands the connected socket over (``tierckpt_daemon.peers.handoff``); the peer sends
the bytes by ``sendfile``, and this process receives them into its tensors and checks each block
against the manifest's checksums (``streamed.StreamedFiles``). Before, the daemon wrote the step into fresh
tmpfs pages (half its time) and the reader then copied it from there.

A range that fails on one peer (it went away, or a block does not match) is read again from the
next peer that holds the file. With peer TLS the daemon hands over one end of a socket pair and
relays the decrypted bytes into it. A daemon that offers no hand-over (an older one), or files
without block checksums, leave the restore to the daemon as before.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterator

import torch

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_client.dcp.sources.base import MemoryFill
from tierckpt_client.dcp.sources.files import LocalFiles
from tierckpt_client.dcp.sources.streamed import CONCURRENCY, StreamedFiles
from tierckpt_core.errors import (
    BlockMismatchError,
    CheckpointFormatError,
    PeerUnavailableError,
    ProtocolError,
    TierCkptError,
)
from tierckpt_core.handoff import HandoffAnswer, HandoffRequest
from tierckpt_core.protocol import PeerSources, handoff_socket

logger = logging.getLogger(__name__)

CHUNK = 1 << 20  # bytes per receive: the piece is copied and hashed while it is in the cache
STREAMS = 4  # connections for one large file
MAX_ANSWER = 4096


class Handoff:
    """Client of the daemon's handoff socket: a connection to a peer, positioned at the body of
    the range asked for."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.path = handoff_socket(config.socket)

    def available(self) -> bool:
        return self.path.is_socket()

    def open(
        self, peer: str, namespace: str, step: int, attempt: str, name: str, start: int, stop: int
    ) -> socket.socket:
        req = HandoffRequest(peer, namespace, step, attempt, name, start, stop)
        fds: list[int] = []  # closed unless handed to the caller
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(self.config.connect_timeout_s)
                conn.connect(str(self.path))
                conn.settimeout(self.config.timeout_s)
                conn.sendall(req.line())
                answer = bytearray()
                while not answer.endswith(b"\n"):
                    data, got, _, _ = socket.recv_fds(conn, MAX_ANSWER, 1)
                    fds += got
                    if not data or len(answer) + len(data) > MAX_ANSWER:
                        raise ProtocolError(f"{self.path}: no answer line from the daemon")
                    answer += data
            refused = HandoffAnswer.from_line(answer, str(self.path)).error()
            if refused is not None:
                raise refused
            if len(fds) != 1:
                raise ProtocolError(f"{self.path}: the daemon answered without a connection")
            sock = socket.socket(fileno=fds.pop())
        except OSError as e:
            raise PeerUnavailableError(
                f"the daemon's handoff socket {self.path}: {type(e).__name__}: {e}"
            ) from e
        finally:
            for fd in fds:
                socket.close(fd)
        sock.settimeout(self.config.timeout_s)
        return sock


class PeerRanges:
    """The ``RangeSource`` of a step the peers hold: bytes of its files through connections the
    daemon hands over, from the first peer that sends them whole and matching."""

    def __init__(self, handoff: Handoff, sources: PeerSources) -> None:
        self.handoff = handoff
        self.manifest = sources.manifest
        self.holders = sources.holders
        self.attempts = sources.attempts  # each peer's copy is its own attempt

    def peers_of(self, name: str) -> list[str]:
        """The peers that hold file ``name``, its writer's node first."""
        f = self.manifest.file(name)
        node = f.node if f is not None else None
        held = [
            p
            for p, files in self.holders.items()
            if (files is None or name in files) and p in self.attempts
        ]
        return sorted(held, key=lambda p: p != node)

    def get_range(
        self, key: str, start: int, end: int, put: Callable[[memoryview, int], None]
    ) -> None:
        m = self.manifest
        errors: list[str] = []
        mismatch: BlockMismatchError | None = None
        bad = 0  # peers whose copy did not match
        peers = self.peers_of(key)
        buf = memoryview(bytearray(min(CHUNK, end - start)))
        for peer in peers:
            attempt = self.attempts[peer]
            try:
                sock = self.handoff.open(peer, m.namespace, m.step, attempt, key, start, end)
            except TierCkptError as e:
                errors.append(f"{peer}: {e}")
                continue
            off = start
            try:
                with sock:
                    while off < end:
                        n = sock.recv_into(buf[: min(len(buf), end - off)])
                        if not n:
                            raise PeerUnavailableError(f"the connection closed at byte {off}")
                        put(buf[:n], off)
                        off += n
                return
            except (OSError, PeerUnavailableError) as e:
                errors.append(f"{peer}: bytes {start}-{end} of {key} stopped at {off}: {e}")
            except BlockMismatchError as e:  # this peer's copy is bad: another may be good
                logger.warning(
                    "%s/step %d: %s from peer %s does not match its checksum (block %d); trying "
                    "the next peer",
                    m.namespace,
                    m.step,
                    key,
                    peer,
                    e.block,
                )
                errors.append(f"{peer}: block {e.block} of {key} does not match its checksum")
                mismatch, bad = e, bad + 1
        if mismatch is not None and bad == len(peers):  # every copy is bad
            raise mismatch
        raise PeerUnavailableError(
            f"{m.namespace}/step {m.step}: no peer could send bytes {start}-{end} of {key} "
            f"({'; '.join(errors) or 'no peer holds it'})"
        )


class PeerSource(MemoryFill):
    """A ``Source`` for a step the peers hold and this node does not: read from them
    straight into the tensors (:class:`StreamedFiles` over :class:`PeerRanges`), then filled into
    this node's memory by the daemon in the background."""

    def __init__(
        self, sources: PeerSources, config: ClientConfig, *, concurrency: int = CONCURRENCY
    ) -> None:
        super().__init__(config)
        self.sources = sources
        self.concurrency = concurrency

    @classmethod
    def offered(
        cls, daemon: DaemonClient, config: ClientConfig, namespace: str, step: int
    ) -> PeerSource | None:
        """The step as the peers hold it, if this process can read it from them: the daemon
        hands connections over and every file has block checksums. None otherwise (the daemon
        then fetches the step into memory first)."""
        handoff = Handoff(config)
        if not handoff.available():
            return None
        try:
            sources = daemon.peer_sources(namespace, step)
        except TierCkptError as e:
            logger.info(
                "%s/step %d: not reading it from the peers directly: %s", namespace, step, e
            )
            return None
        m = sources.manifest
        if not sources.handoff:
            return None
        if any(f.length and not (f.blocks and f.block_size) for f in m.files):
            return None  # no block checksums to verify ranges against
        if (m.namespace, m.step) != (namespace, step):
            raise CheckpointFormatError(
                f"{namespace}/step {step}: the daemon answered for {m.namespace}/step {m.step}"
            )
        return cls(sources, config)

    def metadata(self, namespace: str, step: int) -> str:
        return self.sources.manifest.metadata

    def files(self, where: str, names: set[str] | None, rest: LocalFiles) -> StreamedFiles:
        """The step's files ``names`` (None: all) read from the peers, ``rest`` for the others
        (this node's memory, when it holds them)."""
        m = self.sources.manifest
        return StreamedFiles(
            where,
            PeerRanges(Handoff(self.config), self.sources),
            {f.name: f.name for f in m.files},
            {f.name: f for f in m.files if names is None or f.name in names},
            rest,
            concurrency=self.concurrency,
            streams=STREAMS,
            others_elsewhere=names is not None,
            source="on every peer that holds it",
            remedy="restore an older step, or this one from the persistent tier",
        )

    @contextlib.contextmanager
    def open_files(
        self, namespace: str, step: int, refs: list[ShardRef]
    ) -> Iterator[StreamedFiles]:
        m = self.sources.manifest
        where = f"{namespace}/step {step} on the peers"

        def no_whole(name: str) -> torch.Tensor:
            # Every file with bytes has block checksums (offered); an empty one needs no read.
            f = m.file(name)
            if f is not None and f.length == 0:
                return torch.empty(0, dtype=torch.uint8)
            raise CheckpointFormatError(f"{where}: {name} has no block checksums")

        files = self.files(where, None, LocalFiles(where, no_whole, {}))
        files.fetched = {ref.file for ref in refs}
        try:
            yield files
        finally:
            files.close()
        self.fill_memory(namespace, step)
