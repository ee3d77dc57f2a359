"""Blocks checked in order, the caller told of the checked front (tierckpt_core.verified_front:
what a restore into CUDA tensors copies behind): every block is checked before the caller hears
of it, nothing at or past a bad block is ever announced, and the workers are all waited for."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import pytest

from tierckpt_core import verified_copy
from tierckpt_core.errors import BlockMismatchError
from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.manifest import FileRecord
from tierckpt_core.verified import BlockSums
from tierckpt_core.verified_front import check_in_order

BLOCK = 16 << 10
LENGTH = 40 * BLOCK + 999  # a short last block


def _file() -> tuple[bytearray, BlockSums]:
    data = bytearray(random.Random(5).randbytes(LENGTH))
    whole, size, blocks = checksum_blocks(memoryview(data))
    assert size == BLOCK
    rec = FileRecord(name="r0.data", rank=0, length=LENGTH, checksum=whole, block_size=size,
                     blocks=blocks)  # fmt: skip
    return data, BlockSums.of(rec, where="job/step 3")


def _spawn(n: int, work: Callable[[], int]) -> Sequence[Future[int]]:
    return verified_copy._on_pool(n, work)


class Follower:
    """A copy that follows the front (as ``_device_copy`` queues its DMA): each ``ready(k)``
    copies the bytes of blocks ``[told, k)``, and checks they had been hashed by then."""

    def __init__(self, data: bytearray, sums: BlockSums, hashed: set[int]) -> None:
        self.data, self.sums, self.hashed = data, sums, hashed
        self.dest = bytearray(len(data))
        self.told: list[int] = []

    def __call__(self, k: int) -> None:
        start = self.told[-1] if self.told else 0
        assert k > start, "the front only moves on"
        assert set(range(start, k)) <= self.hashed, "told of a block not checked"
        lo, hi = self.sums.bounds(start)[0], self.sums.bounds(k - 1)[1]
        self.dest[lo:hi] = self.data[lo:hi]
        self.told.append(k)


@pytest.fixture
def hashed(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """The blocks whose checksum was computed so far (xxhash wrapped: by digest, its block)."""
    from tierckpt_core import verified_front

    seen: set[int] = set()
    real = verified_front.xxhash.xxh3_128_hexdigest
    lock = threading.Lock()

    class Wrapped:
        @staticmethod
        def xxh3_128_hexdigest(view: Any) -> str:
            got = real(view)
            time.sleep(0.002)  # slow enough that the front moves while blocks are checked
            with lock:
                seen.update(i for i, d in enumerate(SUMS[0].digests) if d == got)
            return got

    SUMS.clear()
    monkeypatch.setattr(verified_front, "xxhash", Wrapped)
    return seen


SUMS: list[BlockSums] = []


@pytest.mark.parametrize("threads", [1, 4])
def test_the_caller_follows_the_checked_front(threads: int, hashed: set[int]) -> None:
    data, sums = _file()
    SUMS.append(sums)
    follow = Follower(data, sums, hashed)
    blocks = [(data, sums, b) for b in range(len(sums.digests))]
    assert check_in_order(blocks, threads=threads, spawn=_spawn, ready=follow, step=3 * BLOCK) == (
        LENGTH
    )
    assert follow.told[-1] == len(blocks)  # all of it, in steps of at least 3 blocks
    steps = [b - a for a, b in zip([0, *follow.told], follow.told, strict=False)]
    assert all(s >= 3 for s in steps[:-1]) and len(steps) > 1
    assert follow.dest == data


@pytest.mark.parametrize("threads", [1, 4])
def test_nothing_at_or_after_a_bad_block_is_announced(threads: int, hashed: set[int]) -> None:
    data, sums = _file()
    SUMS.append(sums)
    bad = bytearray(data)
    bad[17 * BLOCK + 3] ^= 0x01
    follow = Follower(bad, sums, hashed)
    blocks = [(bad, sums, b) for b in range(len(sums.digests))]
    with pytest.raises(BlockMismatchError) as e:
        check_in_order(blocks, threads=threads, spawn=_spawn, ready=follow, step=BLOCK)
    assert e.value.block == 17
    assert not follow.told or follow.told[-1] <= 17
    assert follow.dest[17 * BLOCK :] == bytes(len(data) - 17 * BLOCK)  # never copied


def test_an_error_of_the_caller_stops_the_workers_and_is_raised(hashed: set[int]) -> None:
    data, sums = _file()
    SUMS.append(sums)
    started: list[Future[int]] = []

    def spawn(n: int, work: Callable[[], int]) -> Sequence[Future[int]]:
        started.extend(_spawn(n, work))
        return started

    def ready(k: int) -> None:
        raise RuntimeError("the copy could not be queued")

    blocks = [(data, sums, b) for b in range(len(sums.digests))]
    with pytest.raises(RuntimeError, match="could not be queued"):
        check_in_order(blocks, threads=3, spawn=spawn, ready=ready, step=BLOCK)
    assert started and all(f.done() for f in started)  # waited for


def test_no_worker_started_the_caller_checks_them_itself(hashed: set[int]) -> None:
    data, sums = _file()
    SUMS.append(sums)
    follow = Follower(data, sums, hashed)
    blocks = [(data, sums, b) for b in range(len(sums.digests))]
    assert check_in_order(blocks, threads=4, spawn=lambda n, w: [], ready=follow) == LENGTH
    assert follow.told == [len(blocks)] and follow.dest == data
