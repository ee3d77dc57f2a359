"""The share table of a step spanning nodes, kept once per ring: a node that is not one of its
holders keeps its digest only, and takes a fetched table only if it matches; the lock per step
that makes such fetches single flight does not outlive its callers."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tierckpt_core.errors import CheckpointFormatError
from tierckpt_core.manifest import RingRecord, Share, StepManifest
from tierckpt_daemon.locks import KeyedLocks

HOLDERS = ["n0:1", "n1:1"]


def _ring(nodes: int) -> RingRecord:
    shares = {
        f"n{i}:1": Share(digest=f"sha256:{i:064x}", files=[f"r{i:05d}.data"], bytes=16384)
        for i in range(nodes)
    }
    return RingRecord(
        shares=shares, metadata_digest="sha256:" + "m" * 64, metadata_holders=list(HOLDERS)
    )


def _kept(ring: RingRecord, node: str) -> bytes:
    m = StepManifest(
        namespace="job", step=1, files=[], metadata={}, coordinator="n0:1", ring=ring.kept_by(node)
    )
    return m.encode()


def test_a_node_that_is_not_a_holder_keeps_the_tables_digest_whatever_the_number_of_nodes() -> None:
    small, large = _ring(16), _ring(64)
    assert len(_kept(small, "n5:1")) == len(_kept(large, "n5:1"))  # digests, not entries
    doc = json.loads(_kept(large, "n5:1"))
    assert "shares" not in doc["ring"] and doc["ring"]["shares_digest"].startswith("sha256:")
    assert json.loads(_kept(large, "n1:1"))["ring"]["shares"]  # a holder keeps the table
    read = StepManifest.decode(_kept(large, "n5:1"), where="here").ring
    assert read is not None and not read.has_table
    with pytest.raises(CheckpointFormatError, match="kept by n0:1, n1:1"):
        read.node_of("r00003.data")


def test_a_fetched_table_is_used_only_if_it_matches_the_digest() -> None:
    ring = _ring(8)
    slim = ring.kept_by("n5:1")
    whole = slim.with_table(ring, where="n0:1's record")
    assert whole.node_of("r00003.data") == "n3:1" and whole.count() == 8
    assert whole == RingRecord.model_validate(whole.model_dump())  # its index is not a field
    forged = _ring(8)
    assert forged.shares is not None
    forged.shares["n3:1"] = Share(digest="sha256:" + "0" * 64, files=["r00003.data"], bytes=1)
    with pytest.raises(CheckpointFormatError, match="does not match the step's digest"):
        slim.with_table(forged, where="n1:1's record")
    with pytest.raises(CheckpointFormatError, match="keeps no share table"):
        slim.with_table(slim, where="n7:1's record")


def test_a_record_with_neither_the_table_nor_its_digest_is_refused() -> None:
    with pytest.raises(ValueError, match="share table or the table's digest"):
        RingRecord(metadata_digest="sha256:x", metadata_holders=HOLDERS)


def test_keyed_locks_serialize_one_key_and_are_dropped_once_no_one_holds_them() -> None:
    locks = KeyedLocks()
    inside: list[int] = []
    overlap = threading.Event()

    def hold(i: int) -> None:
        with locks.held(("job", 1)):
            inside.append(i)
            if len(inside) > 1:
                overlap.set()
            time.sleep(0.01)
            inside.remove(i)

    threads = [threading.Thread(target=hold, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not overlap.is_set()
    for step in range(1000):  # every step ever asked for: none kept once done
        with locks.held(("job", step)):
            pass
    assert len(locks) == 0
