"""What a daemon does for its peers: serve its committed steps, and take in replicas they push.

A pushed replica is an ordinary save attempt in this daemon: each file arrives in a file leased
from the arena (so the budget, the pool and recycling apply), hashed while it is written, is sealed
into the attempt, and the peer's commit names every file's checksum, which must match what arrived.
The committed replica is a step of the namespace like any other, marked with its ``origin``;
retention applies to it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

from tierckpt_client.errors import (
    IntegrityError,
    NotFoundError,
    StepStateError,
    TierCkptError,
)
from tierckpt_client.integrity import Hasher, checksum_file, read_chunks
from tierckpt_client.protocol import (
    CommitRequest,
    LeaseResponse,
    PeerCommitRequest,
    PeerFile,
    PeerManifest,
    PeerStep,
    SealFile,
    SealRequest,
    StepInfo,
    validate_file_name,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.index import read_manifest
from tierckpt_daemon.service import TierService

logger = logging.getLogger(__name__)

SERVE_CHUNK = 1 << 20
RECEIPT_TTL_S = 3600.0


class ReceivedFile:
    """One file being received: written in place into its lease, hashed on the way."""

    def __init__(self, lease: LeaseResponse, length: int) -> None:
        self.lease = lease
        self.length = length
        self.received = 0
        self._hasher = Hasher()
        self._fd = os.open(lease.path, os.O_WRONLY)

    def write(self, data: bytes | bytearray) -> None:
        self._hasher.update(data)
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, self.received)
            view = view[n:]
            self.received += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def hexdigest(self) -> str:
        return self._hasher.hexdigest()


class PeerStore:
    def __init__(self, service: TierService) -> None:
        self.service = service
        self._lock = threading.Lock()
        # (namespace, step, attempt) -> (file name -> checksum of the bytes received), and when
        self._receipts: dict[tuple[str, int, str], tuple[float, dict[str, str]]] = {}

    # -- serving ----------------------------------------------------------------------------
    def list_steps(self, namespace: str) -> list[PeerStep]:
        return [
            PeerStep(
                step=r.step,
                attempt=r.attempt,
                bytes=r.bytes,
                origin=r.origin,
                committed_at=r.committed_at,
            )
            for r in self.service.records(namespace)
        ]

    def manifest(self, namespace: str, step: int) -> PeerManifest:
        rec = self.service.record(namespace, step)
        doc = read_manifest(rec.manifest_path())
        missing = [f for f in rec.files.values() if f.name not in rec.checksums]
        if missing:
            # Neither replicated nor durable yet: checksum the files now (memory bandwidth).
            pin = self.service.pin(namespace, step, rec.attempt)
            try:
                sums = {f.name: checksum_file(pin.paths[f.name], f.length) for f in missing}
            finally:
                self.service.unpin(namespace, step, pin.pin_id)
            self.service.set_checksums(rec, sums)
        return PeerManifest(
            namespace=namespace,
            step=step,
            attempt=rec.attempt,
            world_size=rec.world_size,
            committed_at=rec.committed_at,
            origin=rec.origin,
            files=[
                PeerFile(name=f.name, rank=f.rank, length=f.length, checksum=rec.checksums[f.name])
                for f in sorted(rec.files.values(), key=lambda f: f.name)
            ],
            metadata=doc["metadata"],
        )

    def open_file(
        self, namespace: str, step: int, attempt: str, name: str
    ) -> tuple[int, Iterator[bytes]]:
        """The length of one file of a committed step and an iterator over its bytes; the step
        is pinned until the iterator is exhausted or closed (or the pin expires)."""
        validate_file_name(name)
        pin = self.service.pin(namespace, step, attempt)
        try:
            rec = self.service.record(namespace, step)
            f = rec.files.get(name)
            if f is None or name not in pin.paths:
                raise NotFoundError(f"{namespace}/step {step} has no file {name}")
        except BaseException:
            self.service.unpin(namespace, step, pin.pin_id)
            raise

        def body() -> Iterator[bytes]:
            try:
                yield from read_chunks(pin.paths[name], f.length, SERVE_CHUNK)
            finally:
                with contextlib.suppress(TierCkptError):
                    self.service.unpin(namespace, step, pin.pin_id)

        return f.length, body()

    # -- receiving --------------------------------------------------------------------------
    def begin_file(self, namespace: str, rank: int, length: int) -> ReceivedFile:
        lease = self.service.lease(namespace, rank, length, prefault=False)
        try:
            return ReceivedFile(lease, length)
        except OSError:
            self.service.release_lease(namespace, lease.lease_id)
            raise

    def abort_file(self, namespace: str, rf: ReceivedFile) -> None:
        rf.close()
        with contextlib.suppress(NotFoundError):  # sealed already: the sweeper reclaims it
            self.service.release_lease(namespace, rf.lease.lease_id)

    def finish_file(
        self, namespace: str, step: int, attempt: str, rank: int, name: str, rf: ReceivedFile
    ) -> str:
        """Seal a completely received file into the pending replica; return its checksum."""
        rf.close()
        digest = rf.hexdigest()
        self.service.seal(
            namespace,
            step,
            attempt,
            SealRequest(
                rank=rank, files=[SealFile(lease_id=rf.lease.lease_id, name=name, length=rf.length)]
            ),
        )
        now = time.monotonic()
        with self._lock:
            for key in [k for k, v in self._receipts.items() if now - v[0] > RECEIPT_TTL_S]:
                del self._receipts[key]
            _, sums = self._receipts.setdefault((namespace, step, attempt), (now, {}))
            sums[name] = digest
        return digest

    def commit(self, namespace: str, step: int, attempt: str, req: PeerCommitRequest) -> StepInfo:
        validate_namespace(namespace)
        validate_step(step)
        with self._lock:
            _, received = self._receipts.pop((namespace, step, attempt), (0.0, {}))
        claimed = {f.name: f.checksum for f in req.files}
        missing = sorted(set(claimed) - set(received))
        if missing:
            raise StepStateError(
                f"{namespace}/step {step}: replica {attempt} from {req.origin} lacks "
                f"{len(missing)} files: {', '.join(missing[:8])}"
            )
        bad = sorted(n for n, c in claimed.items() if received[n] != c)
        if bad:
            raise IntegrityError(
                f"{namespace}/step {step}: replica {attempt} from {req.origin}: file {bad[0]} "
                f"arrived with checksum {received[bad[0]]}, the sender says {claimed[bad[0]]}"
            )
        info = self.service.commit(
            namespace,
            step,
            attempt,
            CommitRequest(
                files=sorted(claimed),
                metadata=req.metadata,
                world_size=req.world_size,
                persist=False,
            ),
            origin=req.origin,
            checksums=claimed,
        )
        self.service.metrics.replica_received_bytes.inc(sum(f.length for f in req.files))
        if self.service.replicator is not None:
            self.service.replicator.note_received()
        return info
