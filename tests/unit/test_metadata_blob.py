"""The DCP metadata as the daemons keep it: compressed text the daemon never parses, hashed as
kept; what readers decode is checked like any untrusted input."""

from __future__ import annotations

import base64
import hashlib
import json
import zlib

import pytest
from pydantic import ValidationError

from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.manifest import RingRecord, StepManifest, ring_of
from tierckpt_core.metadata_blob import (
    PREFIX,
    canonical_json,
    metadata_digest,
    pack_metadata,
    unpack_metadata,
)
from tierckpt_core.protocol import CommitRequest

DOC = {
    "format": "tierckpt-dcp-metadata/1",
    "state_dict": {f"layers.{i}.w": {"chunks": [[0, 0], [64, 0]]} for i in range(200)},
}


def test_packed_metadata_round_trips_and_is_much_smaller_than_its_json() -> None:
    text = pack_metadata(DOC)
    assert text.startswith(PREFIX)
    assert unpack_metadata(text, where="here") == DOC
    assert len(text) * 5 < len(json.dumps(DOC))


def test_a_commit_keeps_the_text_as_sent_and_its_digest_is_of_that_text() -> None:
    text = pack_metadata(DOC)
    body = json.dumps({"files": ["r0"], "metadata": text, "world_size": 1})
    req = CommitRequest.model_validate_json(body)
    assert req.metadata is not None and req.metadata == text  # not parsed, not re-encoded
    assert metadata_digest(text) == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    m = StepManifest(namespace="job", step=1, files=[], metadata=req.metadata)
    assert json.loads(m.encode())["metadata"] == text


def test_a_record_of_an_earlier_format_keeps_its_digest() -> None:
    """Records before the text kept the JSON object, and their ring's digest was over its
    canonical JSON: read now, the object becomes that text, so the digest still matches."""
    old_digest = "sha256:" + hashlib.sha256(canonical_json(DOC).encode()).hexdigest()
    doc = {
        "format": "tierckpt-step/1",
        "namespace": "job",
        "step": 3,
        "files": [],
        "metadata": DOC,
        "coordinator": "n0:1",
        "ring": {
            "shares": {"n0:1": {"digest": "sha256:x", "files": [], "bytes": 0}},
            "metadata_digest": old_digest,
            "metadata_holders": ["n0:1"],
        },
    }
    m = StepManifest.decode(json.dumps(doc), where="old")
    assert m.ring is not None and metadata_digest(m.metadata) == m.ring.metadata_digest
    assert unpack_metadata(m.metadata, where="old") == DOC
    # A step of the format before ring records: the ring derived from it has the same digest.
    del doc["ring"]
    derived = ring_of(StepManifest.decode(json.dumps(doc), where="older"))
    assert isinstance(derived, RingRecord) and derived.metadata_digest == old_digest


def test_an_empty_object_is_kept_elsewhere() -> None:
    m = StepManifest(
        namespace="job",
        step=1,
        files=[],
        metadata={},
        ring=RingRecord(
            shares_digest="sha256:t", metadata_digest="sha256:m", metadata_holders=["a"]
        ),
    )
    assert m.metadata == "" and m.metadata_elsewhere


def _packed(raw: bytes) -> str:
    return PREFIX + base64.b64encode(zlib.compress(raw)).decode()


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "keeps no metadata"),
        ("<xml/>", "neither"),
        (PREFIX + "not base64!", "not readable"),
        (PREFIX + base64.b64encode(b"not zlib").decode(), "not readable"),
        (PREFIX + base64.b64encode(zlib.compress(b"{}")[:-3]).decode(), "truncated"),
        (_packed(b"[1, 2]"), "not a JSON object"),
        (_packed(b"{not json"), "not JSON"),
        (_packed(b'{"a": "\xff"}'), "not JSON"),
        ("{not json", "not JSON"),
    ],
)
def test_unreadable_metadata_is_a_format_error_that_says_where(text: str, says: str) -> None:
    with pytest.raises(CheckpointFormatError, match=f"job/step 4: .*{says}"):
        unpack_metadata(text, where="job/step 4")


def test_a_blob_that_inflates_past_the_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("tierckpt_core.metadata_blob.MAX_INFLATED_BYTES", 1 << 16)
    bomb = _packed(b'{"a": "' + b"x" * (1 << 20) + b'"}')
    assert len(bomb) < 8 << 10
    with pytest.raises(CheckpointFormatError, match="inflates past"):
        unpack_metadata(bomb, where="job/step 4")


@pytest.mark.parametrize("sent", ["", "metadata", "eJzLSM3JyQcABiwCFQ==", "[1, 2]"])
def test_a_commit_with_metadata_that_is_neither_text_nor_an_object_is_refused(sent: str) -> None:
    with pytest.raises(ValidationError, match=r"metadata\n.*must be 'zlib\+b64:' text"):
        CommitRequest(files=["r0"], metadata=sent, world_size=1)
    assert CommitRequest(files=["r0"], metadata={}, world_size=1).metadata == "{}"
