"""Wire models shared by the daemon and its clients (torch-free).

The daemon serves ``/v1/...`` over a Unix domain socket for the node's trainers and a TCP port for
probes and peers (``/v1/peer/...``, with a shared token). Every request and response body is one of the pydantic models below;
errors are :class:`ErrorBody` with a stable ``code`` (see :mod:`tierckpt_core.errors`).

Names that end up in paths are validated on both sides by :func:`validate_namespace`,
:func:`validate_file_name` and :func:`validate_step`.
"""

from __future__ import annotations

import enum
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from tierckpt_core.manifest import FileRecord, StepManifest
from tierckpt_core.metadata_blob import MetadataText, SentMetadata

# The wire's name rules, re-exported: the API validates with them.
from tierckpt_core.names import MAX_FILE_BYTES as MAX_FILE_BYTES
from tierckpt_core.names import MAX_NAME_LEN as MAX_NAME_LEN
from tierckpt_core.names import MAX_RANK as MAX_RANK
from tierckpt_core.names import MAX_STEP as MAX_STEP
from tierckpt_core.names import validate_file_name as validate_file_name
from tierckpt_core.names import validate_namespace as validate_namespace
from tierckpt_core.names import validate_rank as validate_rank
from tierckpt_core.names import validate_step as validate_step

API_VERSION = "v1"


def handoff_socket(api_socket: str | os.PathLike[str]) -> Path:
    """The daemon's second Unix socket, beside its API socket: where a trainer is handed
    connections to peers for a restore (:mod:`tierckpt_daemon.peers.handoff`)."""
    path = Path(api_socket)
    return path.with_name(path.name + ".handoff")


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


class LeaseAfter(BaseModel):
    """The save attempt whose commit grants a pre-lease (see :class:`LeaseRequest`)."""

    step: int = Field(ge=0, le=MAX_STEP)
    attempt: str = Field(min_length=1, max_length=MAX_NAME_LEN)


class LeaseRequest(BaseModel):
    """A file of ``size`` bytes for ``rank``, now; or, with ``after``, a pre-lease for the rank's
    next save: the daemon names the file now and puts it in place when that save attempt commits,
    from a file the commit frees (never a new allocation, never by evicting a step). Until then,
    and for good when the commit frees no file of the size, the path does not exist. A pre-lease
    the trainer has not claimed (``flock`` on the file) is taken back under memory pressure and
    when it expires. Daemons older than this field ignore it and grant a plain lease
    (``pending`` false in the answer)."""

    rank: int = Field(ge=0, lt=MAX_RANK)
    size: int = Field(ge=0, le=MAX_FILE_BYTES)
    after: LeaseAfter | None = None


class LeaseResponse(BaseModel):
    lease_id: str
    path: str
    size: int
    recycled: bool
    expires_in_s: float
    pending: bool = False  # a pre-lease: ``path`` appears when the ``after`` attempt commits


class SealFile(BaseModel):
    lease_id: str
    name: str
    length: int = Field(ge=0, le=MAX_FILE_BYTES)
    segments: list[tuple[int, int, str]] | None = None  # see FileRecord.segments
    # The writer's checksums of the bytes it wrote (integrity.checksum_blocks), taken right after
    # writing them; the daemon takes them itself at commit where a writer sends none.
    checksum: str | None = None
    block_size: int | None = None
    blocks: list[str] | None = None


class SealRequest(BaseModel):
    rank: int = Field(ge=0, lt=MAX_RANK)
    files: list[SealFile]


class CommitRequest(BaseModel):
    files: list[str]
    # The DCP metadata as the writer encoded it (tierckpt_core.metadata_blob.pack_metadata): kept
    # and passed on as sent, never parsed by a daemon. A JSON object is taken too (kept as its
    # canonical text).
    metadata: SentMetadata
    world_size: int = Field(ge=1, le=MAX_RANK)
    persist: bool | None = None
    # A step whose ranks used several daemons: file name -> the node (TIERCKPT_NODE_NAME) of the
    # daemon the writing rank sealed it with. The coordinator's daemon commits it on every node.
    nodes: dict[str, str] | None = None
    # False: refuse to replace a committed step of the same number (torch's
    # FileSystemWriter(overwrite=False)); the daemon checks it in the commit itself.
    overwrite: bool = True


class StepInfo(BaseModel):
    namespace: str
    step: int
    state: StepState
    bytes: int
    files: list[FileRecord]
    created_at: float
    committed_at: float | None = None
    world_size: int | None = None
    persist: bool | None = None
    in_memory: bool = True
    replicated_to: list[str] = []  # peers (host:port) that hold a verified copy of this step
    replication_pending: bool = False  # fewer than the configured replicas exist yet
    origin: str | None = None  # set on a replica: the peer that committed the step
    owner: str | None = None  # the identity its namespace belongs to (``uid:<n>``)
    # A save attempt in progress (state "writing") only: its id, whether a process that sealed
    # into it still runs (None: not known here), and in how many seconds the daemon reclaims it
    # if it is not committed (None: prepared for a commit across nodes; its decider ends it).
    attempt: str | None = None
    writer_alive: bool | None = None
    reclaim_in_s: float | None = None


class AttemptInfo(BaseModel):
    """A save attempt of a step that is not committed: written by a trainer now, or left behind
    by one that died mid-save (``tierckpt inspect`` shows it, ``tierckpt rm --abandoned`` frees
    it)."""

    namespace: str
    step: int
    attempt: str
    prepared: bool  # prepared for a commit across nodes: its decider ends it, not the sweep
    bytes: int
    files: list[FileRecord]
    owner: str | None = None
    created_at: float
    idle_s: float  # since a rank last sealed into it
    reclaim_in_s: float | None  # None: prepared (waits for its decider)
    # The processes that sealed into it (pids as the daemon sees them; none where the kernel
    # gave no pid, e.g. another pid namespace), and whether any of them still runs.
    writers: list[int] = []
    writer_alive: bool | None = None


class HydrateRequest(BaseModel):
    """Which files of a step the caller's readers need here (none named: the node's own)."""

    files: list[str] | None = None


class CorruptionReport(BaseModel):
    """What a reader (a trainer's load, ``tierckpt verify``) found corrupt in a step: which file,
    which block of it when known, read from which tier. The daemon counts it in
    ``tierckpt_verification_failures_total{tier}`` and logs it; the reader's own error stands."""

    file: str | None = Field(default=None, max_length=255)
    block: int | None = Field(default=None, ge=0)
    tier: Literal["memory", "peer", "persistent"]
    detail: str = Field(default="", max_length=2000)


class RangesRequest(BaseModel):
    """Parts of one file: ``[offset, length]`` pairs."""

    ranges: list[tuple[int, int]] = Field(max_length=100_000)


class StepCandidate(BaseModel):
    """A step that ``latest`` could return, newest first, and the tiers that hold it."""

    step: int
    in_memory: bool
    durable: bool
    peers: list[str] = []  # peer daemons that hold a replica


class CandidatesListing(BaseModel):
    """``GET .../candidates?complete=true&unanswered=true`` (``tierckpt ls``): every candidate,
    and the peers that did not answer the listing (their copies may be missing from it). A
    daemon older than this answers the plain list."""

    candidates: list[StepCandidate]
    unanswered: list[str] = []


class PeerSources(BaseModel):
    """How a step that is in no memory of this node can be read from its peers: the step's
    manifest (files, block checksums, DCP metadata), which peers hold it (and which of its files;
    None: all), and whether this daemon hands a trainer connections to them
    (:func:`handoff_socket`) for a restore straight into its tensors."""

    manifest: StepManifest
    holders: dict[str, list[str] | None]
    attempts: dict[str, str]  # each holder's save attempt id of its copy (in its file URLs)
    handoff: bool


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
    # Queued steps that were not uploaded: superseded by a new save of the step, or retired from
    # memory first (retention keeps the newest TIERCKPT_KEEP_LAST steps; or deleted).
    skipped_uploads: int = 0
    hydrations: list[HydrationProgress] = []
    uploads: list[HydrationProgress] = []  # the step being uploaded: bytes of its finished files
    # Steps spanning nodes whose decider (this node) waits for other nodes' shares: what for.
    waiting: list[str] = []


class ReplicationStatus(BaseModel):
    node: str  # this daemon's entry on the ring (TIERCKPT_NODE_NAME)
    peers: list[str]  # the ring as last resolved, this node included
    replicas: int  # k: copies pushed to the next k peers on the ring
    queued_steps: int
    replicated_steps: int
    replicated_bytes: int
    received_steps: int
    failed_pushes: int
    skipped_steps: int = 0  # steps never replicated (tierckpt_replication_skips_total)
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


class ReadStamp(BaseModel):
    """A step's commit record in the tier directory (``path``), as ``lstat`` found it when the
    daemon answered: every change of a committed step rewrites that record (a new file renamed
    into place), so a reader that finds the same file there may take the step as unchanged."""

    path: str
    ino: int
    ctime_ns: int
    size: int


class ReadRequest(BaseModel):
    """A committed step in this node's memory, for a load: what it holds, and (``pin``) the step
    pinned for the read. ``known``: the :attr:`ReadResponse.version` whose metadata and file
    records the reader already holds (they are then left out of the answer)."""

    known: str | None = Field(default=None, max_length=200)
    pin: bool = True


class ReadResponse(BaseModel):
    """A step for a load, in one round trip: a version of its commit, the pin and its files' paths
    (when asked to pin), and, unless the reader holds them already (``version`` is the one it
    sent), the step's DCP metadata and its file records with their block checksums (the larger
    part of the answer)."""

    version: str  # the step's committed contents: its commit time and every file's checksum
    stamp: ReadStamp | None = None  # how to tell, without asking, that ``version`` still holds
    pin_id: str | None = None
    paths: dict[str, str] = {}
    expires_in_s: float = 0.0
    metadata: MetadataText | None = None  # as committed: see tierckpt_core.metadata_blob
    files: list[FileRecord] | None = None


class CandidatesRead(BaseModel):
    """``GET .../candidates?read=true[&below=N]``: the candidates for a load of "latest" (of the
    persistent tier, only its newest durable steps: see ``next_below``), and (without ``below``)
    the newest one's :class:`ReadResponse`
    (unpinned, with its metadata and file records) when this node's memory holds it and keeps its
    metadata: a load of "latest" then needs no second request before DCP plans (None otherwise:
    the load asks ``POST .../reads`` as for any step). A daemon older than this answers the
    plain list."""

    candidates: list[StepCandidate]
    read: ReadResponse | None = None
    # The persistent tier may hold durable steps older than this one, the oldest it looked up
    # (only its newest are, for a load; the candidates stop there, older ones in memory or on
    # peers included): ask again with ``below`` this. None: the candidates are all there is.
    next_below: int | None = None


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
    # Background threads that died (each "thread NAME died of ERROR"): the daemon is unhealthy.
    failed_threads: list[str] = []


# -- daemon-to-daemon (peer) routes, /v1/peer/..., TCP only, Authorization: Bearer <token> -------


class PeerStep(BaseModel):
    """One committed step a peer holds (the listing ``latest`` consults)."""

    step: int
    attempt: str
    bytes: int
    origin: str | None
    committed_at: float | None
    held: list[str] | None = None  # a step spanning nodes: the files this peer holds (else all)
    owner: str | None = None  # the identity its namespace belongs to (None: a daemon before owners)


class NodeStep(BaseModel):
    """One committed step a daemon holds in memory, as ``tierckpt ls --cluster`` lists it."""

    namespace: str
    step: int
    state: StepState  # committed (memory), or durable (also complete in the persistent tier)
    bytes: int  # held on this node
    files: int  # files held on this node
    committed_at: float | None = None
    origin: str | None = None  # a replica: the node that committed it
    replicated_to: list[str] = []  # nodes holding a verified replica of it
    replication_pending: bool = False
    coordinator: str | None = None  # a step spanning nodes: the daemon that decided its commit


class NodeListing(BaseModel):
    """What one node holds, or why it could not say."""

    node: str
    reachable: bool
    error: str | None = None  # why it is unreachable
    steps: list[NodeStep] = []


class ClusterListing(BaseModel):
    """Every node's steps, as the asked daemon and its peers answered within ``timeout_s``."""

    node: str | None  # the daemon asked (None: it has no peers)
    timeout_s: float
    nodes: list[NodeListing]


class PrepareRequest(BaseModel):
    """Phase one of a commit across nodes: the coordinator's daemon asks a participant to check
    that its share of the attempt is sealed, record that it is prepared, and say what it holds.
    ``subtree``: participants this one relays the prepare to (node -> its share), so that the
    decider sends O(fan-out) messages, not one per node (see peers/commit.py)."""

    coordinator: str = Field(min_length=3, max_length=300)
    participants: list[str]
    files: list[str]  # this participant's share
    world_size: int = Field(ge=1, le=MAX_RANK)
    subtree: dict[str, list[str]] = {}


class PreparedShare(BaseModel):
    """One participant's prepared share: its files, slim (no block checksums) when it sends
    ``share_digest``, the digest of their full records, which stay with it."""

    files: list[FileRecord]
    share_digest: str | None = None


class PrepareResponse(PreparedShare):
    """A participant's prepared share, and those of the participants it relayed the prepare to."""

    subtree: dict[str, PreparedShare] = {}


class DecideRequest(BaseModel):
    """Phase two: the decision was commit; here is the step's global record. ``relay``: the
    participants this one passes the decision on to (it tells again those that do not answer)."""

    manifest: StepManifest
    persist: bool
    relay: list[str] = []


class OutcomeResponse(BaseModel):
    """How a daemon's part of one save attempt stands: ``committed`` (with the global record),
    ``prepared`` (waiting for the decision), ``writing``, or ``unknown`` (never seen, aborted,
    superseded, or evicted)."""

    outcome: str
    manifest: StepManifest | None = None
    persist: bool = False  # committed: whether the step is to be persisted


class PeerPullRequest(BaseModel):
    """Asks a peer to copy one of the caller's committed steps into its memory tier: the peer
    fetches the step's manifest and files from ``origin`` (which must be a member of its ring),
    verifies every file against the manifest's checksums, and commits the replica."""

    origin: str = Field(min_length=3, max_length=300)
