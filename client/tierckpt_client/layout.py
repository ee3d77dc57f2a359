"""Layout of a step in the persistent tier (S3 or a file system), shared by the daemon and clients.

Torch-free. See docs/format.md::

    <namespace>/step_<step:012d>/<file>          raw shard files, exactly the bytes the writer used
    <namespace>/step_<step:012d>/manifest.json   files with lengths and checksums, the DCP metadata
    <namespace>/step_<step:012d>/COMMITTED       written last; holds the manifest's checksum

A step is durable exactly when its ``COMMITTED`` marker exists and names the checksum of the
manifest next to it; every file is verified against the manifest when it is read back.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tierckpt_client.errors import CheckpointFormatError, IntegrityError
from tierckpt_client.integrity import checksum
from tierckpt_client.protocol import validate_file_name

STEP_FORMAT = "tierckpt-step/1"
MARKER_FORMAT = "tierckpt-commit/1"
MANIFEST = "manifest.json"
MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"step_(\d{12})")


def step_prefix(namespace: str, step: int) -> str:
    return f"{namespace}/step_{step:012d}/"


def file_key(namespace: str, step: int, name: str) -> str:
    return step_prefix(namespace, step) + validate_file_name(name)


def manifest_key(namespace: str, step: int) -> str:
    return step_prefix(namespace, step) + MANIFEST


def marker_key(namespace: str, step: int) -> str:
    return step_prefix(namespace, step) + MARKER


def parse_step_key(namespace: str, key: str) -> tuple[int, str] | None:
    """``(step, rest)`` for a key under ``<namespace>/step_<N>/``, else None."""
    head = f"{namespace}/"
    if not key.startswith(head):
        return None
    step_dir, sep, rest = key[len(head) :].partition("/")
    m = _STEP_DIR.fullmatch(step_dir)
    if not sep or m is None:
        return None
    return int(m.group(1)), rest


@dataclass(frozen=True)
class StoredFile:
    name: str
    rank: int
    length: int
    checksum: str


@dataclass(frozen=True)
class StepManifest:
    namespace: str
    step: int
    world_size: int | None
    committed_at: float | None
    files: tuple[StoredFile, ...]
    metadata: dict[str, Any]

    def encode(self) -> bytes:
        doc = {
            "format": STEP_FORMAT,
            "namespace": self.namespace,
            "step": self.step,
            "world_size": self.world_size,
            "committed_at": self.committed_at,
            "files": [
                {"name": f.name, "rank": f.rank, "length": f.length, "checksum": f.checksum}
                for f in self.files
            ],
            "metadata": self.metadata,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes, *, where: str) -> StepManifest:
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise CheckpointFormatError(f"{where}: manifest is not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != STEP_FORMAT:
            raise CheckpointFormatError(f"{where}: not a {STEP_FORMAT} manifest")
        files = []
        for f in doc.get("files") or []:
            if not isinstance(f, dict):
                raise CheckpointFormatError(f"{where}: manifest file entry is not an object")
            name, rank, length, digest = f.get("name"), f.get("rank"), f.get("length"), f.get("checksum")
            if not (
                isinstance(name, str)
                and isinstance(rank, int)
                and isinstance(length, int)
                and length >= 0
                and isinstance(digest, str)
            ):
                raise CheckpointFormatError(f"{where}: malformed manifest entry {f!r}")
            files.append(StoredFile(validate_file_name(name), rank, length, digest))
        metadata = doc.get("metadata")
        if not isinstance(metadata, dict):
            raise CheckpointFormatError(f"{where}: manifest has no metadata")
        return cls(
            namespace=str(doc.get("namespace")),
            step=int(doc.get("step", -1)),
            world_size=doc.get("world_size"),
            committed_at=doc.get("committed_at"),
            files=tuple(files),
            metadata=metadata,
        )


def encode_marker(manifest_bytes: bytes) -> bytes:
    return json.dumps({"format": MARKER_FORMAT, "manifest": checksum(manifest_bytes)}).encode()


def check_marker(marker: bytes, manifest_bytes: bytes, *, where: str) -> None:
    try:
        doc = json.loads(marker)
    except ValueError:
        raise IntegrityError(f"{where}: the commit marker is not JSON") from None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT:
        raise IntegrityError(f"{where}: not a {MARKER_FORMAT} commit marker")
    if doc.get("manifest") != checksum(manifest_bytes):
        raise IntegrityError(f"{where}: manifest.json does not match the checksum in COMMITTED")
