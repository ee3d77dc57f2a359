"""Step records, their state machine, and the commit record (manifest) that makes a step durable in memory.

State per save attempt of a step: WRITING (ranks seal their files) -> COMMITTED (the coordinator
wrote the manifest) -> DURABLE (the uploader finished it in the persistent tier). Beside the state, a
record lists the peers that hold a verified replica (``replicated_to``), whether more replicas are
still to be pushed (``replication_pending``), and, for a replica received from a peer, its
``origin``. The tier directory is the journal: a step directory with a ``MANIFEST.json``
(a :class:`~tierckpt_core.manifest.StepManifest` written to a temporary name and renamed, so it is
all or nothing) is committed, anything else found after a daemon restart is a save that never
finished and its files are reclaimed.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.integrity import open_regular
from tierckpt_core.manifest import (
    RECORD_FILE,
    FileRecord,
    LocalState,
    RingRecord,
    StepManifest,
    ring_of,
)
from tierckpt_core.protocol import StepInfo, StepState

logger = logging.getLogger(__name__)

MANIFEST = RECORD_FILE
# A participant's record of a step spanning nodes between its prepare and the decision (in doubt).
PREPARED = "MANIFEST.prepared.json"


@dataclass
class StepRecord:
    namespace: str
    step: int
    attempt: str
    dir: Path
    state: StepState = StepState.WRITING
    files: dict[str, FileRecord] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    last_activity: float = field(default_factory=time.monotonic)
    committed_at: float | None = None
    durable_at: float | None = None  # when its upload here, or its marker read, made it durable
    world_size: int | None = None
    # What the writer asked for (None: the daemon's policy); of a step spanning nodes, the
    # decider's decision (what a participant in doubt is told); True once persisted on request.
    persist: bool | None = None
    persist_pending: bool = False  # to be uploaded; must not leave memory before it is durable
    uploading: bool = False  # its upload is running: retention leaves it (eviction.py)
    # A participant of a step spanning nodes: its share is uploaded, the decider writes the
    # marker (share_durable.py), which was last read at this monotonic time.
    share_uploaded: bool = False
    marker_read_at: float = 0.0
    marker_reading: bool = False
    origin: str | None = None  # a replica: the peer (host:port) that committed it
    replicated_to: list[str] = field(default_factory=list)  # peers holding a verified copy
    replication_pending: bool = False  # must not leave memory before it is replicated
    pins: dict[str, float] = field(default_factory=dict)  # pin id -> monotonic expiry
    # Brought into memory for a reader (hydrated from the persistent tier or a peer): retention
    # leaves it until this monotonic time, or until its readers have unpinned it.
    hold_until: float = 0.0
    evict_pending: bool = False
    # A step spanning nodes: the daemon that decides, and, on a participant between prepare and
    # decision, that it has prepared (it must ask the decider).
    coordinator: str | None = None
    participants: list[str] = field(default_factory=list)
    prepared_at: float | None = None
    owner: str | None = None  # the identity its namespace belongs to (see tenants.py)
    # A step spanning nodes: every node's share (its digest, file names, bytes: the share table,
    # on the step's holders only; elsewhere its digest) and where its metadata and table are kept
    # (RingRecord). ``files`` are the ones held here: no record of another node's file is kept
    # (it is fetched from its holders, checked against its share's digest).
    ring: RingRecord | None = None
    # A save attempt: the processes that sealed into it, pid -> start time (see writers.py).
    writers: dict[int, int] = field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return sum(f.held_bytes for f in self.files.values())

    def info(self) -> StepInfo:
        return StepInfo(
            namespace=self.namespace,
            step=self.step,
            state=self.state,
            bytes=self.bytes,
            files=self.sorted_files(),
            created_at=self.created_at,
            committed_at=self.committed_at,
            world_size=self.world_size,
            persist=self.persist,
            replicated_to=list(self.replicated_to),
            replication_pending=self.replication_pending,
            origin=self.origin,
            owner=self.owner,
        )

    def manifest_path(self) -> Path:
        return self.dir / MANIFEST

    def prepared_path(self) -> Path:
        return self.dir / PREPARED

    @property
    def spans_nodes(self) -> bool:
        return self.coordinator is not None

    def holds_all(self) -> bool:
        """Whether every file of the step is held here: a step of one node always; of a step
        spanning nodes, known from its share table only (without it, on a node that is not one
        of the step's holders: False)."""
        ring = self.ring
        if ring is None:
            return True
        if not ring.has_table:
            return False
        return ring.count() == sum(1 for name in self.files if ring.node_of(name) is not None)

    def sorted_files(self) -> list[FileRecord]:
        return sorted(self.files.values(), key=lambda f: f.name)

    def checksums(self) -> dict[str, str]:
        """The files' checksums known so far."""
        return {f.name: f.checksum for f in self.files.values() if f.checksum}

    def learn_checksums(self, checksums: dict[str, str]) -> None:
        """Record checksums of files that have none yet (the first one taken is kept)."""
        for name, digest in checksums.items():
            f = self.files.get(name)
            if f is not None and f.checksum is None:
                f.checksum = digest

    def manifest(self, metadata: str) -> StepManifest:
        return StepManifest(
            namespace=self.namespace,
            step=self.step,
            attempt=self.attempt,
            world_size=self.world_size,
            created_at=self.created_at,
            committed_at=self.committed_at,
            files=self.sorted_files(),
            metadata=metadata,
            coordinator=self.coordinator,
            owner=self.owner,
            ring=self.ring,
            local=LocalState(
                participants=list(self.participants) or None,
                persist=self.persist,
                persist_pending=self.persist_pending,
                share_uploaded=self.share_uploaded,
                durable=self.state == StepState.DURABLE,
                durable_at=self.durable_at,
                origin=self.origin,
                replicated_to=list(self.replicated_to),
                replication_pending=self.replication_pending,
            ),
        )


# The daemon names the attempts it fills itself (hydration.fill_step) with a letter a trainer's
# attempt id (hex, see tierckpt_client.dcp._plan_data.attempt_base) never starts with: "h" hydrated from the
# persistent tier, "p" restored from a peer, "r" a replica received from a peer.
FILLED_ATTEMPT_PREFIXES = ("h", "p", "r")


def filled_by_daemon(attempt: str) -> bool:
    """Whether a step's attempt was brought in by the daemon rather than saved by a trainer."""
    return attempt.startswith(FILLED_ATTEMPT_PREFIXES)


def committed_here(rec: StepRecord) -> bool:
    """Whether ``rec`` is a save this node's trainers committed (alone, or their share of a
    step spanning nodes), not a copy a peer or the persistent tier sent."""
    return rec.origin is None and not filled_by_daemon(rec.attempt)


def step_dir_name(step: int, attempt: str) -> str:
    return f"{step:012d}-{attempt}"


def parse_step_dir_name(name: str) -> tuple[int, str] | None:
    head, sep, attempt = name.partition("-")
    if not sep or not head.isdigit() or not attempt:
        return None
    return int(head), attempt


def write_manifest(record: StepRecord, metadata: str) -> None:
    _write(record, record.manifest(metadata))


def write_prepared(record: StepRecord) -> None:
    """A participant's prepare: its share and the decider, before it acknowledges."""
    _write_atomically(record.prepared_path(), record.manifest("").encode())


def update_manifest(record: StepRecord) -> None:
    """Rewrite the commit record's state fields (durable, checksums), keeping its metadata."""
    _write(record, record.manifest(read_manifest(record.manifest_path()).metadata))


def _write(record: StepRecord, manifest: StepManifest) -> None:
    _write_atomically(record.manifest_path(), manifest.encode())


def _write_atomically(path: Path, data: bytes) -> None:
    """Write ``path`` all or nothing: a new temporary file (never one found there, never through
    a link: the directory is writable by the node's training processes), then a rename."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # removes a link itself, not its target
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.rename(tmp, path)


def read_manifest(path: Path) -> StepManifest:
    try:
        fd = open_regular(str(path))
        try:
            with os.fdopen(fd, "rb", closefd=False) as fh:
                data = fh.read()
        finally:
            os.close(fd)
    except OSError as e:
        raise CheckpointFormatError(f"cannot read commit record {path}: {e}") from e
    return StepManifest.decode(data, where=str(path))


def record_from_manifest(namespace: str, step_dir: Path, doc: StepManifest) -> StepRecord:
    """Rebuild a committed record, checking that every listed file is there with its size."""
    parsed = parse_step_dir_name(step_dir.name)
    if parsed is None or doc.namespace != namespace or doc.step != parsed[0]:
        raise CheckpointFormatError(f"{step_dir}: commit record does not match its directory")
    local = doc.local or LocalState()
    held = set(local.held) if local.held is not None else {f.name for f in doc.files}
    rec = StepRecord(
        namespace=namespace,
        step=parsed[0],
        attempt=parsed[1],
        dir=step_dir,
        state=StepState.DURABLE if local.durable else StepState.COMMITTED,
        created_at=doc.created_at or 0.0,
        committed_at=doc.committed_at or 0.0,
        durable_at=local.durable_at,
        world_size=doc.world_size,
        persist=local.persist,
        persist_pending=local.persist_pending,
        share_uploaded=local.share_uploaded,
        origin=local.origin,
        replicated_to=list(local.replicated_to),
        replication_pending=local.replication_pending,
        coordinator=doc.coordinator,
        owner=doc.owner,
        # A committed step of the format before ring records gets the one it would have had.
        ring=ring_of(doc) if local.participants is None else doc.ring,
    )
    for f in doc.files:
        if f.name not in held:
            continue  # a record of the previous format: another node's file (now in ``ring``)
        path = step_dir / f.name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointFormatError(f"{step_dir}: file {f.name} is missing") from None
        if size != f.size:
            raise CheckpointFormatError(
                f"{step_dir}: file {f.name} has {size} bytes, the record says {f.size}"
            )
        rec.files[f.name] = f
    return rec
