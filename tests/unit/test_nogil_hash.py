"""The GIL-free block hash (``tierckpt_core.nogil_hash``): xxhash's digests, other threads run
during it, and the verified copies use it for small blocks over several threads."""

from __future__ import annotations

import random
import sys
import threading

import pytest
import xxhash

from tierckpt_core import nogil_hash, verified_copy
from tierckpt_core.errors import BlockMismatchError
from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.verified import BlockSums
from tierckpt_core.verified_copy import Copy, check_all, copy_all


def _hex_at() -> nogil_hash.HexAt:
    hex_at = nogil_hash.hexdigest_at()
    assert hex_at is not None, "xxhash's extension exports XXH3_128bits on this platform"
    return hex_at


@pytest.mark.parametrize("kind", [bytes, bytearray])
def test_it_gives_xxhash_digests_at_any_offset_and_length(kind: type) -> None:
    hex_at = _hex_at()
    rnd = random.Random(7)
    data = kind(rnd.randbytes(300_000))
    view = memoryview(data)
    base = nogil_hash.address(view)
    assert base is not None
    for _ in range(200):
        at = rnd.randrange(0, len(data))
        n = rnd.choice([0, 1, 15, 16, 17, 240, 241, 4096, 65536, rnd.randrange(len(data) - at)])
        n = min(n, len(data) - at)
        assert hex_at(base + at, n) == xxhash.xxh3_128_hexdigest(view[at : at + n])


def test_other_threads_run_while_it_hashes() -> None:
    """While one thread hashes, another runs Python: ctypes released the GIL (xxhash's own call
    on blocks of 64 KiB holds it: the other thread then waits for the switch interval)."""
    hex_at = _hex_at()
    data = bytearray(64 << 10)
    base = nogil_hash.address(memoryview(data))
    assert base is not None
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.5)  # a thread waiting for the GIL asks for it after 0.5 s only

    def ran_beside(hash_once: object) -> int:
        stop = threading.Event()
        count = [0]
        started = threading.Event()

        def spin() -> None:
            started.set()
            while not stop.is_set():
                count[0] += 1
                threading.Event().wait(0)  # hands the GIL back at once

        t = threading.Thread(target=spin)
        t.start()
        started.wait(10)
        before = count[0]
        for _ in range(3000):
            hash_once()  # type: ignore[operator]
        ran = count[0] - before
        stop.set()
        t.join(10)
        return ran

    try:
        beside_ctypes = ran_beside(lambda: hex_at(base, len(data)))
        beside_xxhash = ran_beside(lambda: xxhash.xxh3_128_hexdigest(data))
    finally:
        sys.setswitchinterval(old)
    assert beside_ctypes > 10 * max(beside_xxhash, 1), (beside_ctypes, beside_xxhash)


def _file(length: int) -> tuple[bytes, BlockSums]:
    data = random.Random(length).randbytes(length)
    _, size, blocks = checksum_blocks(memoryview(data))
    assert size <= verified_copy.GIL_HELD_MAX  # blocks xxhash hashes under the GIL
    return data, BlockSums("r0.data", length, size, blocks, where="job/step 3")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of the GIL-free hash."""
    hex_at = _hex_at()
    calls = [0]

    def spy(address: int, length: int) -> str:
        calls[0] += 1
        return hex_at(address, length)

    monkeypatch.setattr(nogil_hash, "_FOUND", [spy])
    return calls


def test_check_all_hashes_small_blocks_over_threads_without_the_gil(counted: list[int]) -> None:
    data, sums = _file(3 << 20)  # 192 blocks of 16 KiB
    blocks = [(data, sums, b) for b in range(len(sums.digests))]
    assert check_all(blocks, threads=3) == len(data)
    assert counted[0] == len(sums.digests)
    bad = bytearray(data)
    bad[100 * sums.size + 5] ^= 1
    with pytest.raises(BlockMismatchError) as e:
        check_all([(bytes(bad), sums, b) for b in range(len(sums.digests))], threads=3)
    assert e.value.block == 100
    counted[0] = 0
    assert check_all(blocks, threads=1) == len(data)  # one thread: xxhash's own, faster call
    assert counted[0] == 0


def test_copy_all_hashes_small_blocks_over_threads_without_the_gil(
    counted: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(verified_copy, "PARALLEL_MIN", 1 << 20)  # several runs for 3 workers
    data, sums = _file(6 << 20)
    dest = bytearray(len(data))
    assert copy_all([Copy(dest, sums, 0, src=data)], threads=3) == len(data)
    assert dest == data
    assert counted[0] == len(sums.digests)
    bad = bytearray(data)
    bad[200 * sums.size] ^= 1
    with pytest.raises(BlockMismatchError) as e:
        copy_all([Copy(bytearray(len(data)), sums, 0, src=bytes(bad))], threads=3)
    assert e.value.block == 200
