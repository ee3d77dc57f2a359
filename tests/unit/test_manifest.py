"""The one manifest model: tmpfs commit record, persistent-tier manifest and peer manifest."""

from __future__ import annotations

import json

import pytest

from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.manifest import FileRecord, LocalState, StepManifest


def _manifest() -> StepManifest:
    return StepManifest(
        namespace="job",
        step=7,
        attempt="a1",
        world_size=2,
        committed_at=1.5,
        files=[
            FileRecord(name="r00000.data", rank=0, length=10, size=4096, checksum="xxh3_128:aa"),
            FileRecord(name="r00001.data", rank=1, length=12, size=4096, checksum="xxh3_128:bb"),
        ],
        metadata={"format": "tierckpt-dcp-metadata/1"},
        local=LocalState(persist_pending=True, replicated_to=["10.0.0.2:8474"]),
    )


def test_round_trip_keeps_everything() -> None:
    m = _manifest()
    assert StepManifest.decode(m.encode(), where="here") == m


def test_portable_drops_local_state_and_arena_sizes() -> None:
    doc = json.loads(_manifest().portable().encode())
    assert "local" not in doc
    assert all("size" not in f for f in doc["files"])
    assert [f["checksum"] for f in doc["files"]] == ["xxh3_128:aa", "xxh3_128:bb"]


def test_reads_the_commit_record_of_an_older_daemon() -> None:
    legacy = {
        "format": "tierckpt-manifest/1",
        "namespace": "job",
        "step": 3,
        "attempt": "x",
        "world_size": 1,
        "persist": None,
        "persist_pending": True,
        "durable": True,
        "origin": "10.0.0.9:8474",
        "replicated_to": ["10.0.0.2:8474"],
        "replication_pending": False,
        "created_at": 1.0,
        "committed_at": 2.0,
        "files": [{"name": "r00000.data", "rank": 0, "size": 4096, "length": 5, "checksum": None}],
        "metadata": {},
    }
    m = StepManifest.decode(json.dumps(legacy), where="old")
    assert m.local is not None
    assert (m.local.durable, m.local.persist_pending, m.local.origin) == (
        True,
        True,
        "10.0.0.9:8474",
    )
    assert m.local.replicated_to == ["10.0.0.2:8474"]
    assert m.files[0].checksum is None and m.files[0].size == 4096


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"format": "something-else/9"}, "format"),
        ({"files": [{"name": "../etc/passwd", "rank": 0, "length": 1}]}, "files.0.name"),
        ({"files": [{"name": "f", "rank": -1, "length": 1}]}, "files.0.rank"),
        ({"metadata": None}, "metadata"),
    ],
)
def test_malformed_manifests_are_format_errors_that_say_where(
    doc: dict[str, object], says: str
) -> None:
    base = json.loads(_manifest().encode())
    base.update(doc)
    with pytest.raises(CheckpointFormatError, match=rf"s3://b/job: .*{says}"):
        StepManifest.decode(json.dumps(base), where="s3://b/job")


def test_missing_checksums_are_refused_where_bytes_are_verified() -> None:
    m = _manifest()
    m.files[1].checksum = None
    with pytest.raises(CheckpointFormatError, match=r"no checksum for r00001\.data"):
        m.require_checksums(where="peer 10.0.0.2:8474")
