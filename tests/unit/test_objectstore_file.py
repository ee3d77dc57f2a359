"""FileStore (file:// persistent tier), StoreSettings and open_store URL parsing."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from tierckpt_core.errors import (
    IntegrityError,
    InvalidNameError,
    NotFoundError,
    PersistentTierError,
)
from tierckpt_core.integrity import checksum
from tierckpt_core.objectstore import (
    CHUNK_SIZE,
    FileStore,
    ObjectInfo,
    S3Store,
    StoreSettings,
    open_store,
)


@pytest.fixture
def store(tmp_path: Path) -> FileStore:
    s = open_store(f"file://{tmp_path}/store")
    assert isinstance(s, FileStore)
    return s


def test_put_file_prefix_round_trip(store: FileStore, tmp_path: Path) -> None:
    data = os.urandom(2 * CHUNK_SIZE + 12345)
    src = tmp_path / "src.bin"
    src.write_bytes(data + b"trailing garbage")
    digest = store.put_file("ns/step_000000000001/rank0.bin", str(src), length=len(data))
    assert digest == checksum(data)
    assert store.get_bytes("ns/step_000000000001/rank0.bin") == data

    buf = bytearray(len(data))
    assert store.get_into("ns/step_000000000001/rank0.bin", memoryview(buf)) == digest
    assert buf == data

    # whole file by default; no temp files left behind
    assert store.put_file("whole.bin", str(src)) == checksum(src.read_bytes())
    assert sorted(p.name for p in (tmp_path / "store").iterdir()) == ["ns", "whole.bin"]


def test_put_file_shorter_than_length(store: FileStore, tmp_path: Path) -> None:
    src = tmp_path / "short.bin"
    src.write_bytes(b"abc")
    with pytest.raises(PersistentTierError, match="short"):
        store.put_file("k", str(src), length=10)
    assert not store.exists("k")
    assert store.list("") == []


def test_bytes_round_trip_and_overwrite(store: FileStore) -> None:
    assert store.put_bytes("a/b", b"one") == checksum(b"one")
    assert store.put_bytes("a/b", b"second") == checksum(b"second")
    assert store.get_bytes("a/b") == b"second"
    assert store.exists("a/b")
    assert not store.exists("a/c")
    assert store.put_bytes("empty", b"") == checksum(b"")
    assert store.get_into("empty", memoryview(bytearray())) == checksum(b"")


def test_get_into_size_mismatch_and_missing(store: FileStore) -> None:
    store.put_bytes("k", b"12345")
    with pytest.raises(IntegrityError, match="5 bytes, expected 4"):
        store.get_into("k", memoryview(bytearray(4)))
    with pytest.raises(NotFoundError, match="'nope'"):
        store.get_into("nope", memoryview(bytearray(4)))
    with pytest.raises(NotFoundError, match="'nope'"):
        store.get_bytes("nope")


def test_list_sorted_relative_and_prefix(store: FileStore) -> None:
    for key in ["s/step_2/b", "s/step_10/a", "s/step_1/z", "s/step_1/a", "t/x", "top"]:
        store.put_bytes(key, key.encode())
    assert store.list("s/step_1/") == [
        ObjectInfo("s/step_1/a", len(b"s/step_1/a")),
        ObjectInfo("s/step_1/z", len(b"s/step_1/z")),
    ]
    # S3 semantics: a prefix is a string prefix, not a directory
    assert [o.key for o in store.list("s/step_1")] == ["s/step_1/a", "s/step_1/z", "s/step_10/a"]
    assert [o.key for o in store.list("")] == [
        "s/step_1/a",
        "s/step_1/z",
        "s/step_10/a",
        "s/step_2/b",
        "t/x",
        "top",
    ]
    assert store.list("missing/") == []


def test_list_dirs_names_each_directory_once_and_follows_no_link(
    store: FileStore, tmp_path: Path
) -> None:
    for key in ["s/step_2/b", "s/step_10/a", "s/step_1/z", "s/step_1/deep/a", "s/top", "t/x"]:
        store.put_bytes(key, key.encode())
    outside = tmp_path / "outside"
    (outside / "d").mkdir(parents=True)
    os.symlink(outside, store.root / "s" / "step_99")  # a link is no directory of the store
    assert store.list_dirs("s/") == ["step_1", "step_10", "step_2"]
    assert store.list_dirs("") == ["s", "t"]
    assert store.list_dirs("s/step_1/") == ["deep"]
    assert store.list_dirs("missing/") == []
    with pytest.raises(InvalidNameError, match="ends with '/'"):
        store.list_dirs("s/step_")
    with pytest.raises(InvalidNameError):
        store.list_dirs("../")


def test_delete(store: FileStore, tmp_path: Path) -> None:
    store.put_bytes("s/step_1/a", b"1")
    store.put_bytes("s/step_1/b", b"2")
    store.put_bytes("s/step_2/a", b"3")
    store.delete(["s/step_1/a", "s/step_1/b", "never/existed"])
    assert [o.key for o in store.list("")] == ["s/step_2/a"]
    assert not (tmp_path / "store" / "s" / "step_1").exists()  # empty dirs are dropped
    store.delete([])


def test_delete_drops_the_temporary_files_of_writes_a_dead_process_left(
    store: FileStore, tmp_path: Path
) -> None:
    """A daemon killed mid-upload left ``<file>.tierckpt-tmp.<id>`` behind, hidden from every
    listing and never removed (its step's directory stayed too). Deleting the step's objects
    now drops those untouched for an hour; a fresher one may be a write in progress: kept."""
    store.put_bytes("s/step_1/a", b"1")
    store.put_bytes("s/step_2/a", b"2")
    step_1, step_2 = (tmp_path / "store" / "s" / f"step_{n}" for n in (1, 2))
    stale = step_1 / "b.tierckpt-tmp.0123456789ab"
    stale.write_bytes(b"half a file")
    hours_ago = os.stat(stale).st_mtime - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    fresh = step_2 / "b.tierckpt-tmp.ba9876543210"
    fresh.write_bytes(b"a write going on")
    store.delete(["s/step_1/a", "s/step_2/a"])
    assert not step_1.exists()  # the stale one gone, and its directory with it
    assert fresh.read_bytes() == b"a write going on"
    assert store.list("") == []


@pytest.mark.parametrize(
    "key", ["", "/abs", "a//b", "a/../b", "..", "./a", "a/", "a\\b", "a\x00b", "x.tierckpt-tmp.1"]
)
def test_bad_keys(store: FileStore, key: str) -> None:
    with pytest.raises(InvalidNameError):
        store.put_bytes(key, b"x")
    with pytest.raises(InvalidNameError):
        store.get_bytes(key)
    with pytest.raises(InvalidNameError):
        store.delete([key])


def test_health(store: FileStore, tmp_path: Path) -> None:
    store.health()  # creates the root
    assert (tmp_path / "store").is_dir()
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(PersistentTierError, match="not usable"):
        FileStore(blocker / "sub").health()


@pytest.mark.parametrize(
    "url",
    [
        "http://bucket/x",
        "s3:///prefix-without-bucket",
        "file://relative/path",
        "file:relative",
        "/abs/path",
        "s3://bucket/p?x=1",
        "",
    ],
)
def test_open_store_rejects(url: str) -> None:
    with pytest.raises(InvalidNameError, match="accepted forms"):
        open_store(url)


def test_open_store_s3_without_network() -> None:
    settings = StoreSettings(endpoint="http://127.0.0.1:1", force_path_style=True)
    s = open_store("s3://bkt/a/b/", settings)
    assert isinstance(s, S3Store)
    assert (s.bucket, s.prefix, s.url) == ("bkt", "a/b", "s3://bkt/a/b")
    assert (s.endpoint, s.force_path_style) == ("http://127.0.0.1:1", True)
    clone = pickle.loads(pickle.dumps(s))
    assert clone.url == s.url
    with pytest.raises(InvalidNameError):
        open_store("s3://bkt/a/../b", settings)


def test_settings_from_env() -> None:
    assert StoreSettings.from_env({}) == StoreSettings()
    s = StoreSettings.from_env(
        {
            "TIERCKPT_S3_ENDPOINT": "http://h:1",
            "AWS_DEFAULT_REGION": "eu-west-1",
            "TIERCKPT_S3_FORCE_PATH_STYLE": "Yes",
            "TIERCKPT_S3_TIMEOUT": "2.5",
            "TIERCKPT_S3_MAX_ATTEMPTS": "3",
        }
    )
    assert s == StoreSettings("http://h:1", "eu-west-1", True, 2.5, 3)
    assert StoreSettings.from_env({"AWS_REGION": "a", "TIERCKPT_S3_REGION": "b"}).region == "b"
    assert StoreSettings.from_env({"TIERCKPT_S3_FORCE_PATH_STYLE": "0"}).force_path_style is False
    with pytest.raises(PersistentTierError, match="TIERCKPT_S3_TIMEOUT"):
        StoreSettings.from_env({"TIERCKPT_S3_TIMEOUT": "soon"})


def test_upload_rate_limit_caps_average_bandwidth(tmp_path: Path) -> None:
    import time

    from tierckpt_core import objectstore

    src = tmp_path / "src"
    src.write_bytes(b"x" * (4 << 20))
    # 8 MiB/s: 4 MiB (after a first free chunk) >= ~0.4 s
    store = objectstore.open_store(
        f"file://{tmp_path}/store", objectstore.StoreSettings(upload_max_rate=8 << 20)
    )
    t0 = time.monotonic()
    store.put_file("a", str(src))
    store.put_file("b", str(src))
    assert time.monotonic() - t0 >= 0.4
