"""Step records, their state machine, and the commit record (manifest) that makes a step durable in memory.

State per save attempt of a step: WRITING (ranks seal their files) -> COMMITTED (the coordinator
wrote the manifest) -> DURABLE (the uploader finished it in the persistent tier). Beside the state, a
record lists the peers that hold a verified replica (``replicated_to``), whether more replicas are
still to be pushed (``replication_pending``), and, for a replica received from a peer, its
``origin``. The tier directory is the journal: a step directory with a ``MANIFEST.json``
(written to a temporary name and renamed, so it is all or nothing) is committed, anything else found
after a daemon restart is a save that never finished and its files are reclaimed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.protocol import FileInfo, StepInfo, StepState

logger = logging.getLogger(__name__)

MANIFEST = "MANIFEST.json"
MANIFEST_FORMAT = "tierckpt-manifest/1"


@dataclass
class FileRecord:
    name: str
    rank: int
    size: int  # bytes the file occupies (page-rounded)
    length: int  # bytes the writer used

    def info(self) -> FileInfo:
        return FileInfo(name=self.name, rank=self.rank, size=self.size, length=self.length)


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
    world_size: int | None = None
    persist: bool | None = None  # what the writer asked for (None: the daemon's policy)
    persist_pending: bool = False  # to be uploaded; must not leave memory before it is durable
    checksums: dict[str, str] = field(default_factory=dict)  # file name -> checksum, once known
    origin: str | None = None  # a replica: the peer (host:port) that committed it
    replicated_to: list[str] = field(default_factory=list)  # peers holding a verified copy
    replication_pending: bool = False  # must not leave memory before it is replicated
    pins: dict[str, float] = field(default_factory=dict)  # pin id -> monotonic expiry
    evict_pending: bool = False

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def info(self) -> StepInfo:
        return StepInfo(
            namespace=self.namespace,
            step=self.step,
            state=self.state,
            bytes=self.bytes,
            files=[
                f.info().model_copy(update={"checksum": self.checksums.get(f.name)})
                for f in sorted(self.files.values(), key=lambda f: f.name)
            ],
            created_at=self.created_at,
            committed_at=self.committed_at,
            world_size=self.world_size,
            persist=self.persist,
            replicated_to=list(self.replicated_to),
            replication_pending=self.replication_pending,
            origin=self.origin,
        )

    def manifest_path(self) -> Path:
        return self.dir / MANIFEST


def step_dir_name(step: int, attempt: str) -> str:
    return f"{step:012d}-{attempt}"


def parse_step_dir_name(name: str) -> tuple[int, str] | None:
    head, sep, attempt = name.partition("-")
    if not sep or not head.isdigit() or not attempt:
        return None
    return int(head), attempt


def write_manifest(record: StepRecord, metadata: dict[str, Any]) -> None:
    _write_doc(record, {**_record_fields(record), "metadata": metadata})


def update_manifest(record: StepRecord) -> None:
    """Rewrite the commit record's state fields (durable, checksums), keeping its metadata."""
    doc = read_manifest(record.manifest_path())
    doc.update(_record_fields(record))
    _write_doc(record, doc)


def _record_fields(record: StepRecord) -> dict[str, Any]:
    return {
        "format": MANIFEST_FORMAT,
        "namespace": record.namespace,
        "step": record.step,
        "attempt": record.attempt,
        "world_size": record.world_size,
        "persist": record.persist,
        "created_at": record.created_at,
        "committed_at": record.committed_at,
        "persist_pending": record.persist_pending,
        "durable": record.state == StepState.DURABLE,
        "origin": record.origin,
        "replicated_to": list(record.replicated_to),
        "replication_pending": record.replication_pending,
        "files": [
            {
                "name": f.name,
                "rank": f.rank,
                "size": f.size,
                "length": f.length,
                "checksum": record.checksums.get(f.name),
            }
            for f in sorted(record.files.values(), key=lambda f: f.name)
        ],
    }


def _write_doc(record: StepRecord, doc: dict[str, Any]) -> None:
    tmp = record.dir / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    os.rename(tmp, record.manifest_path())


def read_manifest(path: Path) -> dict[str, Any]:
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointFormatError(f"cannot read commit record {path}: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise CheckpointFormatError(f"{path} is not a {MANIFEST_FORMAT} commit record")
    return doc


def record_from_manifest(namespace: str, step_dir: Path, doc: dict[str, Any]) -> StepRecord:
    """Rebuild a committed record, checking that every listed file is there with its size."""
    parsed = parse_step_dir_name(step_dir.name)
    if parsed is None or doc.get("namespace") != namespace or doc.get("step") != parsed[0]:
        raise CheckpointFormatError(f"{step_dir}: commit record does not match its directory")
    rec = StepRecord(
        namespace=namespace,
        step=parsed[0],
        attempt=parsed[1],
        dir=step_dir,
        state=StepState.COMMITTED,
        created_at=float(doc.get("created_at") or 0.0),
        committed_at=float(doc.get("committed_at") or 0.0),
        world_size=doc.get("world_size"),
        persist=doc.get("persist"),
        persist_pending=bool(doc.get("persist_pending")),
        replication_pending=bool(doc.get("replication_pending")),
    )
    origin = doc.get("origin")
    rec.origin = origin if isinstance(origin, str) else None
    replicated_to = doc.get("replicated_to")
    if isinstance(replicated_to, list):
        rec.replicated_to = [p for p in replicated_to if isinstance(p, str)]
    if doc.get("durable"):
        rec.state = StepState.DURABLE
    for f in doc.get("files", []):
        path = step_dir / f["name"]
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointFormatError(f"{step_dir}: file {f['name']} is missing") from None
        if size != f["size"]:
            raise CheckpointFormatError(
                f"{step_dir}: file {f['name']} has {size} bytes, the record says {f['size']}"
            )
        rec.files[f["name"]] = FileRecord(f["name"], int(f["rank"]), size, int(f["length"]))
        if isinstance(f.get("checksum"), str):
            rec.checksums[f["name"]] = f["checksum"]
    return rec
