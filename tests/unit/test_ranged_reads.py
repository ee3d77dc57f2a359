"""``StreamedFiles``: reads of a durable file's ranges straight into destination tensors, verified
block by block, through a real ``FileStore`` (the S3 store is exercised by
tests/integration/test_restore_direct.py)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_client.dcp.sources.files import LocalFiles
from tierckpt_client.dcp.sources.streamed import StreamedFiles
from tierckpt_core.errors import IntegrityError
from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.manifest import FileRecord
from tierckpt_core.objectstore.file import FileStore

LENGTH = 3 * (1 << 20) + 12_345  # 64 KiB blocks, an odd tail
KEY = "ns/step_000000000001/r0.data"


def _stored(tmp_path: Path) -> tuple[FileStore, FileRecord, bytes]:
    data = torch.randint(
        0, 256, (LENGTH,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    raw = data.numpy().tobytes()
    whole, size, blocks = checksum_blocks(memoryview(raw))
    store = FileStore(tmp_path / "store")
    store.put_bytes(KEY, raw)
    rec = FileRecord(
        name="r0.data", rank=0, length=LENGTH, checksum=whole, block_size=size, blocks=blocks
    )
    return store, rec, raw


def _files(store: object, rec: FileRecord) -> StreamedFiles:
    def no_whole(name: str) -> torch.Tensor:
        raise AssertionError("a file with block checksums is never downloaded whole")

    return StreamedFiles(
        "ns/step 1",
        store,  # type: ignore[arg-type]
        {rec.name: KEY},
        {rec.name: rec},
        LocalFiles("ns/step 1", no_whole, {}),
        concurrency=2,
    )


def _wants() -> list[tuple[ShardRef, torch.Tensor | None]]:
    return [
        # a tensor starting and ending inside blocks it shares with its neighbours
        (ShardRef("r0.data", 1000, 4 * 5000, "float32", (5000,)), torch.ones(5000)),
        # a small item right after it, read privately (a bytes item, or a tensor to convert)
        (ShardRef("r0.data", 21_000, 100), None),
        # far away: a second ranged read
        (
            ShardRef("r0.data", 3 * (1 << 20) + 7, 12_000, "int16", (6000,)),
            torch.ones(6000, dtype=torch.int16),
        ),
    ]


def test_ranges_land_in_their_tensors_bit_exact_and_verified(tmp_path: Path) -> None:
    store, rec, raw = _stored(tmp_path)
    files = _files(store, rec)
    wants = _wants()
    files.prefetch(wants)
    for ref, target in wants:
        want = raw[ref.offset : ref.offset + ref.length]
        if target is None:
            assert files.read_bytes(ref.file, ref.offset, ref.length, "item") == want
        else:
            assert files.read_into(ref.file, ref.offset, ref.length, target)
            assert target.view(torch.uint8).numpy().tobytes() == want
    # whole blocks around each range were checked, not more: block 0 and the last one
    size = rec.block_size
    assert size == 64 << 10
    touched = {
        b
        for ref, _ in wants
        for b in range(ref.offset // size, (ref.offset + ref.length - 1) // size + 1)
    }
    assert touched == {0, LENGTH // size}
    assert files.verified_bytes == sum(min(size, LENGTH - b * size) for b in touched)
    # a range nobody announced is read (and verified) on demand
    part = files.region("r0.data", 500_000, 10, "late")
    assert part.numpy().tobytes() == raw[500_000:500_010]


@pytest.mark.parametrize("at", [500, 21_050, 25_000])  # before the tensor, in the item, in a gap
def test_a_flipped_byte_in_any_fetched_block_fails_the_read(tmp_path: Path, at: int) -> None:
    store, rec, raw = _stored(tmp_path)
    bad = bytearray(raw)
    bad[at] ^= 0x80
    store.put_bytes(KEY, bytes(bad))
    files = _files(store, rec)
    block = at // rec.block_size  # type: ignore[operator]
    with pytest.raises(
        IntegrityError, match=rf"r0\.data in the persistent tier .* \(block {block}, "
    ):
        files.prefetch(_wants())


class _RetryingStore:
    """A store whose first attempt of each read delivers garbage for a while and then fails,
    and whose retry starts again at the beginning, as ``S3Store`` does after a timeout."""

    def __init__(self, inner: FileStore) -> None:
        self.inner = inner
        self.retried = 0

    def get_range(
        self, key: str, start: int, end: int, put: Callable[[memoryview, int], None]
    ) -> None:
        half = (end - start) // 2
        put(memoryview(b"\x00" * half), start)  # cut short before its first block ended
        self.retried += 1
        self.inner.get_range(key, start, end, put)


def test_a_retried_read_starts_its_checks_again(tmp_path: Path) -> None:
    store, rec, raw = _stored(tmp_path)
    # one block per read, so the garbage never completes a block before the retry
    wants: list[tuple[ShardRef, torch.Tensor | None]] = [
        (
            ShardRef("r0.data", 16 << 10, 16 << 10, "uint8", (16 << 10,)),
            torch.zeros(16 << 10, dtype=torch.uint8),
        )
    ]
    flaky = _RetryingStore(store)
    files = _files(flaky, rec)
    files.prefetch(wants)
    assert flaky.retried == 1
    target = wants[0][1]
    assert target is not None
    assert target.numpy().tobytes() == raw[16 << 10 : 32 << 10]
