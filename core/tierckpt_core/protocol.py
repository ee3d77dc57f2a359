"""Wire models shared by the daemon and its clients (torch-free).

The daemon serves ``/v1/...`` over a Unix domain socket for the node's trainers and a TCP port for
probes and peers (``/v1/peer/...``, with a shared token). Every request and response body is one of the pydantic models below;
errors are :class:`ErrorBody` with a stable ``code`` (see :mod:`tierckpt_core.errors`).

Names that end up in paths are validated on both sides by :func:`validate_namespace`,
:func:`validate_file_name` and :func:`validate_step`.
"""

from __future__ import annotations

import enum
import re
from typing import Any

from pydantic import BaseModel, Field

from tierckpt_core.errors import InvalidNameError

API_VERSION = "v1"

MAX_NAME_LEN = 128
MAX_STEP = 10**12 - 1  # steps are laid out as step_{N:012d}
MAX_RANK = 1 << 20
MAX_FILE_BYTES = 1 << 44  # 16 TiB: a sanity bound, the capacity is the real one

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def _validate_name(kind: str, value: object) -> str:
    if not isinstance(value, str):
        raise InvalidNameError(f"{kind} must be a string, got {type(value).__name__}")
    if not value or len(value) > MAX_NAME_LEN:
        raise InvalidNameError(f"{kind} {value!r} must be 1 to {MAX_NAME_LEN} characters long")
    if not _NAME_RE.fullmatch(value) or ".." in value:
        raise InvalidNameError(
            f"{kind} {value!r} may only contain letters, digits, '.', '_' and '-', must start "
            "with a letter or digit and must not contain '..'"
        )
    return value


def validate_namespace(namespace: object) -> str:
    """Return ``namespace`` if it is a valid namespace, else raise :class:`InvalidNameError`."""
    return _validate_name("namespace", namespace)


def validate_file_name(name: object) -> str:
    """Return ``name`` if it is a valid shard file name, else raise :class:`InvalidNameError`."""
    return _validate_name("file name", name)


def validate_step(step: object) -> int:
    """Return ``step`` as an int if it is a valid step number, else raise :class:`InvalidNameError`."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidNameError(f"step must be an integer, got {step!r}")
    if not 0 <= step <= MAX_STEP:
        raise InvalidNameError(f"step {step} is out of range 0..{MAX_STEP}")
    return step


def validate_rank(rank: object) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < MAX_RANK:
        raise InvalidNameError(f"rank must be an integer in 0..{MAX_RANK - 1}, got {rank!r}")
    return rank


class StepState(str, enum.Enum):
    """Life cycle of a step in one daemon: WRITING -> COMMITTED -> DURABLE.

    Replication to peers runs beside the upload, in either order, so it is not a state: a step's
    ``replicated_to`` lists the peers that hold a verified copy (see :class:`StepInfo`).
    """

    WRITING = "writing"
    COMMITTED = "committed"
    DURABLE = "durable"  # committed, and complete in the persistent tier


class ErrorBody(BaseModel):
    code: str
    detail: str


class LeaseRequest(BaseModel):
    rank: int = Field(ge=0, lt=MAX_RANK)
    size: int = Field(ge=0, le=MAX_FILE_BYTES)


class LeaseResponse(BaseModel):
    lease_id: str
    path: str
    size: int
    recycled: bool
    expires_in_s: float


class SealFile(BaseModel):
    lease_id: str
    name: str
    length: int = Field(ge=0, le=MAX_FILE_BYTES)


class SealRequest(BaseModel):
    rank: int = Field(ge=0, lt=MAX_RANK)
    files: list[SealFile]


class CommitRequest(BaseModel):
    files: list[str]
    metadata: dict[str, Any]
    world_size: int = Field(ge=1, le=MAX_RANK)
    persist: bool | None = None


class FileInfo(BaseModel):
    name: str
    rank: int
    size: int
    length: int
    checksum: str | None = None  # once the daemon knows it (uploaded, replicated or hydrated)


class StepInfo(BaseModel):
    namespace: str
    step: int
    state: StepState
    bytes: int
    files: list[FileInfo]
    created_at: float
    committed_at: float | None = None
    world_size: int | None = None
    persist: bool | None = None
    in_memory: bool = True
    replicated_to: list[str] = []  # peers (host:port) that hold a verified copy of this step
    replication_pending: bool = False  # fewer than the configured replicas exist yet
    origin: str | None = None  # set on a replica: the peer that committed the step


class StepCandidate(BaseModel):
    """A step that ``latest`` could return, newest first, and the tiers that hold it."""

    step: int
    in_memory: bool
    durable: bool
    peers: list[str] = []  # peer daemons that hold a replica


class HydrationProgress(BaseModel):
    namespace: str
    step: int
    done_bytes: int
    total_bytes: int


class PersistentStatus(BaseModel):
    url: str
    healthy: bool | None
    last_error: str | None
    queued_steps: int
    uploaded_bytes: int
    uploaded_steps: int
    failed_uploads: int
    hydrations: list[HydrationProgress] = []
    uploads: list[HydrationProgress] = []  # the step being uploaded: bytes of its finished files


class ReplicationStatus(BaseModel):
    node: str  # this daemon's entry on the ring (TIERCKPT_NODE_NAME)
    peers: list[str]  # the ring as last resolved, this node included
    replicas: int  # k: copies pushed to the next k peers on the ring
    queued_steps: int
    replicated_steps: int
    replicated_bytes: int
    received_steps: int
    failed_pushes: int
    unreachable: list[str]  # peers whose last call failed
    last_error: str | None


class NamespaceInfo(BaseModel):
    namespace: str
    steps: int
    committed_steps: int
    bytes: int
    latest_committed: int | None


class PinResponse(BaseModel):
    pin_id: str
    step: StepInfo
    paths: dict[str, str]
    expires_in_s: float


class StatusResponse(BaseModel):
    version: str
    api_version: str
    shm_dir: str
    capacity_bytes: int
    used_bytes: int
    pool_bytes: int
    pool_files: int
    leased_bytes: int
    keep_last: int
    namespaces: list[NamespaceInfo]
    persistent: PersistentStatus | None = None
    replication: ReplicationStatus | None = None


# -- daemon-to-daemon (peer) routes, /v1/peer/..., TCP only, Authorization: Bearer <token> -------


class PeerFile(BaseModel):
    name: str
    rank: int = Field(ge=0, lt=MAX_RANK)
    length: int = Field(ge=0, le=MAX_FILE_BYTES)
    checksum: str


class PeerStep(BaseModel):
    """One committed step a peer holds (the listing ``latest`` consults)."""

    step: int
    attempt: str
    bytes: int
    origin: str | None
    committed_at: float | None


class PeerManifest(BaseModel):
    """Everything needed to rebuild a step elsewhere: files with checksums and the DCP metadata."""

    namespace: str
    step: int
    attempt: str
    world_size: int | None
    committed_at: float | None
    origin: str | None
    files: list[PeerFile]
    metadata: dict[str, Any]


class PeerPullRequest(BaseModel):
    """Asks a peer to copy one of the caller's committed steps into its memory tier: the peer
    fetches the step's manifest and files from ``origin`` (which must be a member of its ring),
    verifies every file against the manifest's checksums, and commits the replica."""

    origin: str = Field(min_length=3, max_length=300)
