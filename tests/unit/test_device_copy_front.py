"""A restore into CUDA tensors with its copies following the checked front
(``_device_copy.CHECK_FIRST``), its bookkeeping run on CPU: the device copy's one CUDA call,
``_issue`` (a piece queued on a side stream), is a plain byte copy here and records what it was
asked to copy. The CUDA path itself runs in tests/integration/test_cuda_paths.py where CUDA exists.

What a user would notice: every tensor lands bit-exact, including tensors that share a block
and blocks this load checked before; a bad block fails the load naming it, and no byte of that
block, nor of any later one, is ever queued to a device."""

from __future__ import annotations

import itertools
import random
import time

import pytest
import torch
import xxhash

from tierckpt_client.dcp import _device_copy
from tierckpt_core.errors import BlockMismatchError
from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.manifest import FileRecord
from tierckpt_core.verified import BlockSums

BLOCK = 16 << 10


def _file(name: str, length: int, seed: int) -> tuple[torch.Tensor, BlockSums]:
    data = bytearray(random.Random(seed).randbytes(length))
    whole, size, blocks = checksum_blocks(memoryview(data))
    assert size == BLOCK
    rec = FileRecord(name=name, rank=0, length=length, checksum=whole, block_size=size,
                     blocks=blocks)  # fmt: skip
    return torch.frombuffer(data, dtype=torch.uint8), BlockSums.of(rec, where="job/step 3")


@pytest.fixture
def queued(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Each piece ``_issue`` was asked for: (file, first byte, end byte), copied on CPU."""
    asked: list[tuple[str, int, int]] = []

    def issue(c: _device_copy.DeviceCopy, lo: int, hi: int, streams: dict) -> None:
        flat = c.target.reshape(-1).view(torch.uint8)
        flat[lo:hi].copy_(c.src[c.offset + lo : c.offset + hi])
        asked.append((c.sums.name, c.offset + lo, c.offset + hi))

    monkeypatch.setattr(_device_copy, "_issue", issue)
    monkeypatch.setattr(_device_copy, "CHECK_FIRST", True)
    monkeypatch.setattr(_device_copy, "VERIFY_THREADS", 4)
    monkeypatch.setattr(_device_copy, "GIL_HELD_MAX", 0)  # threads, for blocks this small
    monkeypatch.setattr("tierckpt_core.verified_front.STEP", 2 * BLOCK)  # many pieces

    class Slow:  # the checks slow enough that the front moves while the copies are queued
        @staticmethod
        def xxh3_128_hexdigest(view: object) -> str:
            time.sleep(0.002)
            return xxhash.xxh3_128_hexdigest(view)

    monkeypatch.setattr("tierckpt_core.verified_front.xxhash", Slow)
    return asked


def _copies(
    files: dict[str, tuple[torch.Tensor, BlockSums]], layout: list[tuple[str, int, int]]
) -> list[_device_copy.DeviceCopy]:
    out = []
    for name, offset, length in layout:
        src, sums = files[name]
        blocks = list(range(sums.block_of(offset), sums.block_of(offset + length - 1) + 1))
        target = torch.full((length // 4,), -1, dtype=torch.int32)  # 4-byte elements
        out.append(_device_copy.DeviceCopy(src, sums, offset, target, blocks))
    return out


def _landed(c: _device_copy.DeviceCopy) -> bool:
    n = c.target.numel() * 4
    return torch.equal(c.target.view(torch.uint8), c.src[c.offset : c.offset + n])


def test_tensors_land_bit_exact_behind_the_checks(queued: list[tuple[str, int, int]]) -> None:
    files = {"a": _file("a", 9 * BLOCK + 400, 1), "b": _file("b", 5 * BLOCK, 2)}
    # Out of file order; two tensors share a block of "a"; one of "b" spans all of it.
    layout = [("b", 0, 5 * BLOCK), ("a", 4 * BLOCK + 100, 4 * BLOCK), ("a", 0, 4 * BLOCK + 100)]
    copies = _copies(files, layout)
    checked = _device_copy.land(copies, pin=False)
    assert checked == 14 * BLOCK  # each block read checked once: 9 of "a", 5 of "b"
    assert all(_landed(c) for c in copies)
    # The pieces cover each tensor once, in more than one piece per file (the front moved).
    for name, offset, length in layout:
        mine = sorted(
            (lo, hi) for n, lo, hi in queued if n == name and offset <= lo < offset + length
        )
        assert mine[0][0] == offset and mine[-1][1] == offset + length
        assert all(a[1] == b[0] for a, b in itertools.pairwise(mine))
    assert len(queued) > len(layout)


def test_blocks_checked_earlier_in_the_load_are_queued_at_once(
    queued: list[tuple[str, int, int]],
) -> None:
    files = {"a": _file("a", 8 * BLOCK, 3)}
    (c,) = _copies(files, [("a", 0, 8 * BLOCK)])
    c.blocks = [4, 5, 6, 7]  # 0-3 were checked by an earlier copy of this load
    assert _device_copy.land([c], pin=False) == 4 * BLOCK
    assert queued[0] == ("a", 0, 4 * BLOCK)  # before any check of this call
    assert _landed(c)


def test_a_bad_block_fails_and_nothing_from_it_on_is_queued(
    queued: list[tuple[str, int, int]],
) -> None:
    src, sums = _file("a", 12 * BLOCK, 4)
    src[7 * BLOCK + 9] ^= 0x01
    copies = _copies({"a": (src, sums)}, [("a", 0, 6 * BLOCK), ("a", 6 * BLOCK, 6 * BLOCK)])
    with pytest.raises(BlockMismatchError) as e:
        _device_copy.land(copies, pin=False)
    assert e.value.block == 7
    assert all(hi <= 7 * BLOCK for _, _, hi in queued)
