"""One model of a committed step, wherever it is written down.

The same :class:`StepManifest` is the commit record on tmpfs (``MANIFEST.json`` in the step's
directory), the manifest in the persistent tier (``manifest.json``, see :mod:`tierckpt_core.layout`),
and what one daemon sends another for a replica or a restore. Each file of the step is one
:class:`FileRecord`, which carries the file's checksum from the moment it is known; every reader
verifies the bytes it gets against it.

What only the daemon that holds the step needs (upload and replication bookkeeping) is the
:class:`LocalState` in ``local``; :meth:`StepManifest.portable` drops it, and the files' memory-tier
sizes, before a manifest leaves the node.

Manifests are untrusted input where they are read: :meth:`StepManifest.decode` turns anything
malformed into :class:`~tierckpt_core.errors.CheckpointFormatError` naming where it came from.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.metadata_blob import MetadataText
from tierckpt_core.metadata_blob import metadata_digest as metadata_digest
from tierckpt_core.names import MAX_FILE_BYTES, MAX_RANK, MAX_STEP, validate_file_name

FORMAT = "tierckpt-step/1"
# The tmpfs commit record of daemons before the one manifest model: same fields, with the local
# state at the top level. Still read, so that a daemon upgraded in place keeps its steps.
_LEGACY_LOCAL_FORMAT = "tierckpt-manifest/1"
_LEGACY_LOCAL_FIELDS = (
    "persist",
    "persist_pending",
    "durable",
    "origin",
    "replicated_to",
    "replication_pending",
)


RECORD_FILE = "MANIFEST.json"
"""The commit record's name in a step's directory of the memory tier (a reader that cannot
decode a step's metadata reports it as this file)."""


class FileRecord(BaseModel):
    """One file of a step: its name, the rank that wrote it, and the bytes it holds."""

    model_config = ConfigDict(extra="ignore")

    name: str
    rank: int = Field(ge=0, lt=MAX_RANK)
    length: int = Field(ge=0, le=MAX_FILE_BYTES)  # bytes the writer used
    size: int | None = Field(default=None, ge=0)  # memory tier: bytes the file occupies (its lease)
    checksum: str | None = None  # of the first ``length`` bytes, once known (integrity.checksum)
    node: str | None = None  # a step spanning nodes: the daemon (host:port) the writing rank used
    # Checksums of the file's blocks of ``block_size`` bytes (a step spanning nodes): a reader on
    # another node can then fetch just the ranges it needs, verified block by block.
    block_size: int | None = None
    blocks: list[str] | None = None
    # Checksums the writing rank took of small items in the file, ``(offset, length, digest)``:
    # a reader on another node fetches such an item alone, verified (it may sit between large
    # ones, where a block would bring much more than it).
    segments: list[tuple[int, int, str]] | None = None

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        return validate_file_name(v)

    @property
    def held_bytes(self) -> int:
        """Bytes the file takes where it is held: its size in the memory tier, else its length."""
        return self.length if self.size is None else self.size

    @property
    def slim(self) -> bool:
        """Whether the block checksums and segments are left out (a file of another node's share
        in a step's global record: they stay with the file, see :class:`RingRecord`)."""
        return self.length > 0 and not (self.blocks and self.block_size)

    def slimmed(self) -> FileRecord:
        """This record as the global record of a step spanning nodes carries it to other nodes:
        name, rank, length, whole checksum and node; no block checksums, no segments."""
        return self.model_copy(
            update={"size": None, "block_size": None, "blocks": None, "segments": None}
        )


def _digest(doc: Any) -> str:
    data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(data).hexdigest()


def share_digest(files: list[FileRecord]) -> str:
    """The digest of one node's share of a step: what a reader checks the share's full file
    records (block checksums, segments) against when it fetches them from the node or a replica."""
    return _digest(
        [
            [f.name, f.rank, f.length, f.checksum, f.block_size, f.blocks, f.segments]
            for f in sorted(files, key=lambda f: f.name)
        ]
    )


class Share(BaseModel):
    """One node's share of a step spanning nodes, as every node's record of the step carries it:
    the digest of its full file records (``share_digest``: what a record fetched from the node or
    a replica is checked against), the names of its files and their bytes. The records themselves
    (rank, checksums, block checksums, segments) stay with the files."""

    model_config = ConfigDict(extra="ignore")

    digest: str
    # None only while a record of the previous format is read (its shares were bare digests,
    # its other nodes' files listed slim in ``files``): StepManifest fills it from those.
    files: list[str] | None = None
    bytes: int = Field(default=0, ge=0)

    @field_validator("files")
    @classmethod
    def _valid_names(cls, v: list[str] | None) -> list[str] | None:
        if v is not None:
            for name in v:
                validate_file_name(name)
        return v

    @classmethod
    def of(cls, files: list[FileRecord]) -> Share:
        """The entry of a share whose full records are ``files``."""
        return cls(
            digest=share_digest(files),
            files=sorted(f.name for f in files),
            bytes=sum(f.length for f in files),
        )

    @property
    def names(self) -> list[str]:
        return self.files or []


def table_digest(shares: dict[str, Share]) -> str:
    """The digest of a step's share table (every node's :class:`Share`): what a node that keeps
    only the digest checks a table fetched from the step's holders against."""
    return _digest({n: [s.digest, sorted(s.names), s.bytes] for n, s in shares.items()})


class RingRecord(BaseModel):
    """What a step spanning nodes records of the whole job, so that no node keeps the whole
    job's record: its *share table* (per node its :class:`Share`: a digest of its share's file
    records, its file names and bytes; the records themselves, with their block checksums, stay
    with the files: on the node and its replicas), and where the DCP metadata is kept (the
    decider and its next nodes; the persistent tier once durable), with its digest.

    The table and the metadata are kept once per ring: on the ``metadata_holders`` (and in the
    persistent tier). Every other node keeps ``shares`` None and ``metadata`` empty, with their
    digests, and fetches them on demand, checked against those."""

    model_config = ConfigDict(extra="ignore")

    # node -> the files it holds as their writer's daemon; None: kept by the holders only.
    shares: dict[str, Share] | None = None
    # Of ``shares`` (table_digest). None only in records from before it, which keep the table.
    shares_digest: str | None = None
    metadata_digest: str
    metadata_holders: list[str]  # the decider first
    # name -> node, built once from ``shares`` (the dict it was built from, to notice a new one).
    _index: tuple[dict[str, Share], dict[str, str]] | None = PrivateAttr(default=None)

    @field_validator("shares", mode="before")
    @classmethod
    def _bare_digests(cls, v: Any) -> Any:
        # The previous format: node -> digest (the files named in the manifest's slim records).
        if isinstance(v, dict):
            return {n: {"digest": s} if isinstance(s, str) else s for n, s in v.items()}
        return v

    @model_validator(mode="after")
    def _table_or_digest(self) -> RingRecord:
        if self.shares is None and self.shares_digest is None:
            raise ValueError("a ring record needs its share table or the table's digest")
        return self

    def __eq__(self, other: object) -> bool:
        # The fields only: not whether a copy has built its index yet.
        if not isinstance(other, RingRecord):
            return NotImplemented
        return self._fields() == other._fields()

    def _fields(self) -> tuple[Any, ...]:
        return (self.shares, self.shares_digest, self.metadata_digest, self.metadata_holders)

    @property
    def has_table(self) -> bool:
        """Whether this copy keeps the share table (a holder's, the persistent tier's)."""
        return self.shares is not None

    @property
    def table(self) -> dict[str, Share]:
        """The share table; CheckpointFormatError on a copy that keeps only its digest (the
        caller fetches it from the holders first: see the daemon's ``ring_table``)."""
        if self.shares is None:
            raise CheckpointFormatError(
                "this copy of the step's ring record keeps only its share table's digest; the "
                f"table is kept by {', '.join(self.metadata_holders)}"
            )
        return self.shares

    def digest_of_table(self) -> str:
        if self.shares is not None:
            return table_digest(self.shares)
        assert self.shares_digest is not None  # _table_or_digest
        return self.shares_digest

    def kept_by(self, node: str | None) -> RingRecord:
        """The record as ``node`` keeps it: whole on the holders, else without the share table
        (its digest only), so that a node's record does not grow with the number of nodes."""
        if self.shares is None or node in self.metadata_holders:
            return self
        return RingRecord(
            shares=None,
            shares_digest=self.digest_of_table(),
            metadata_digest=self.metadata_digest,
            metadata_holders=list(self.metadata_holders),
        )

    def with_table(self, table: RingRecord, *, where: str) -> RingRecord:
        """This record with the share table of ``table`` (another copy of it, fetched from a
        holder), which must hash to this record's digest of it: CheckpointFormatError if not."""
        if table.shares is None:
            raise CheckpointFormatError(f"{where} keeps no share table of the step")
        if self.shares is not None:
            return self
        if table_digest(table.shares) != self.shares_digest:
            raise CheckpointFormatError(
                f"{where}: its share table does not match the step's digest"
            )
        return RingRecord(
            shares=table.shares,
            shares_digest=self.shares_digest,
            metadata_digest=self.metadata_digest,
            metadata_holders=list(self.metadata_holders),
        )

    def holders_for(self, node: str | None) -> list[str]:
        """The holders of the table and the metadata other than ``node``, in the order
        ``node`` asks them: from one chosen by a hash of its name, so that a whole job's restore
        spreads its fetches over the holders instead of all asking the decider."""
        holders = [h for h in self.metadata_holders if h != node]
        if holders:
            first = zlib.crc32((node or "").encode()) % len(holders)
            holders = holders[first:] + holders[:first]
        return holders

    def _names_index(self) -> dict[str, str]:
        table = self.table
        if self._index is None or self._index[0] is not table:
            self._index = (table, {name: n for n, s in table.items() for name in s.names})
        return self._index[1]

    def node_of(self, name: str) -> str | None:
        """The node whose share holds file ``name`` (None: not a file of the step)."""
        return self._names_index().get(name)

    def names(self) -> set[str]:
        """Every file of the step."""
        return set(self._names_index())

    def count(self) -> int:
        """How many files the step has."""
        return len(self._names_index())


class LocalState(BaseModel):
    """A daemon's bookkeeping of a step it holds in memory (only on its own tmpfs)."""

    model_config = ConfigDict(extra="ignore")

    persist: bool | None = None  # what the writer asked for (None: the daemon's policy)
    persist_pending: bool = False  # to be uploaded; must not leave memory before it is durable
    share_uploaded: bool = False  # a participant's share uploaded; the decider writes the marker
    durable: bool = False  # complete in the persistent tier
    durable_at: float | None = None  # its upload here, or its marker read, made it durable (wall)
    origin: str | None = None  # a replica: the peer (host:port) that committed it
    replicated_to: list[str] = []  # peers holding a verified copy
    replication_pending: bool = False  # must not leave memory before it is replicated
    held: list[str] | None = None  # the files held in this directory, when not all of them
    participants: list[str] | None = None  # prepared, not yet decided: the daemons of the step


class StepManifest(BaseModel):
    """A committed step: its files (with checksums) and the DCP metadata that describes them."""

    model_config = ConfigDict(extra="ignore")

    format: str = FORMAT
    namespace: str
    step: int = Field(ge=0, le=MAX_STEP)
    attempt: str | None = None
    world_size: int | None = None
    created_at: float | None = None
    committed_at: float | None = None
    files: list[FileRecord]
    # The DCP metadata as the writer encoded it, kept opaque (tierckpt_core.metadata_blob); ""
    # on a node that leaves it to the step's holders.
    metadata: MetadataText
    coordinator: str | None = None  # a step spanning nodes: the daemon that decided its commit
    # The identity the step's namespace belongs to (``uid:<n>`` of the trainer that committed
    # it); it travels with every copy, so that peers keep tenants apart. None: saved by a daemon
    # from before owners (anyone's).
    owner: str | None = None
    # A step spanning nodes, committed by a daemon that keeps the record per node (see RingRecord):
    # ``files`` lists the files this copy's node holds (the persistent tier's: every file), the
    # others are in ``ring.shares``; ``metadata`` and ``ring.shares`` are left out on nodes that do
    # not keep them (their digests are there). (Records of earlier formats, which list the other
    # nodes' files slim or keep the share table everywhere, are read as well.)
    ring: RingRecord | None = None
    local: LocalState | None = None

    @model_validator(mode="before")
    @classmethod
    def _upgrade_legacy(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("format") == _LEGACY_LOCAL_FORMAT:
            data = dict(data)
            data["local"] = {k: data.pop(k) for k in _LEGACY_LOCAL_FIELDS if k in data}
            data["format"] = FORMAT
        return data

    @model_validator(mode="after")
    def _legacy_shares(self) -> StepManifest:
        # A record of the previous format: its shares' files are the slim records in ``files``.
        if self.ring is not None and self.ring.shares is not None:
            for node, share in self.ring.shares.items():
                if share.files is None:
                    mine = [f for f in self.files if f.node == node]
                    share.files = sorted(f.name for f in mine)
                    share.bytes = sum(f.length for f in mine)
        return self

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v != FORMAT:
            raise ValueError(f"format {v!r} is not {FORMAT!r}")
        return v

    def file(self, name: str) -> FileRecord | None:
        return next((f for f in self.files if f.name == name), None)

    @property
    def nbytes(self) -> int:
        return sum(f.length for f in self.files)

    def nodes(self) -> list[str]:
        """The daemons that hold the step's files (empty for a single-node step)."""
        if self.ring is not None:
            return sorted(self.ring.table)
        return sorted({f.node for f in self.files if f.node is not None})

    def share(self, node: str) -> list[FileRecord]:
        """The records in this manifest of the files ``node`` holds as their writer's daemon."""
        return [f for f in self.files if f.node == node]

    def share_names(self, node: str) -> set[str]:
        """The names of the files ``node`` holds as their writer's daemon (of a step spanning
        nodes: from its ring record, whether or not this copy lists their records)."""
        ring = ring_of(self)
        if ring is not None:
            share = ring.table.get(node)
            return set(share.names) if share is not None else set()
        return {f.name for f in self.share(node)}

    @property
    def metadata_elsewhere(self) -> bool:
        """Whether this copy of the record leaves the DCP metadata to its holders."""
        return self.ring is not None and self.metadata in ("", "{}")

    def portable(self) -> StepManifest:
        """This manifest as it leaves the node: no local state, no memory-tier sizes."""
        return self.model_copy(
            update={
                "local": None,
                "files": [f.model_copy(update={"size": None}) for f in self.files],
            }
        )

    def encode(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    @classmethod
    def decode(cls, data: bytes | str, *, where: str) -> StepManifest:
        try:
            return cls.model_validate_json(data)
        except ValidationError as e:
            first = e.errors()[0]
            loc = ".".join(str(p) for p in first["loc"]) or "manifest"
            raise CheckpointFormatError(
                f"{where}: not a valid {FORMAT} manifest ({loc}: {first['msg']})"
            ) from None

    def require_checksums(self, *, where: str) -> None:
        """Raise unless every file has a checksum (what a reader verifies against)."""
        missing = [f.name for f in self.files if not f.checksum]
        if missing:
            raise CheckpointFormatError(
                f"{where}: the manifest has no checksum for {', '.join(missing[:8])}"
            )


def ring_of(manifest: StepManifest) -> RingRecord | None:
    """The ring record of a step spanning nodes; for one committed before ring records (every
    node kept every file's full record and the metadata), the one it would have had. None: a
    step of one node."""
    if manifest.ring is not None or manifest.coordinator is None:
        return manifest.ring
    by_node: dict[str, list[FileRecord]] = {}
    for f in manifest.files:
        by_node.setdefault(f.node or manifest.coordinator, []).append(f)
    others = sorted(n for n in by_node if n != manifest.coordinator)
    shares = {n: Share.of(files) for n, files in by_node.items()}
    return RingRecord(
        shares=shares,
        shares_digest=table_digest(shares),
        metadata_digest=metadata_digest(manifest.metadata),
        metadata_holders=[manifest.coordinator, *others],
    )
