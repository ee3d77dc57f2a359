"""The one verified stream (tierckpt_core.verified): exact bytes land, a flipped byte in any block
fails naming the file, the block and the source, a source that ends early fails."""

from __future__ import annotations

import concurrent.futures
import ctypes
import itertools
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tierckpt_core import integrity, verified_copy
from tierckpt_core import threads as work_threads
from tierckpt_core.errors import (
    BlockMismatchError,
    IntegrityError,
    PeerUnavailableError,
    UnavailableError,
    error_from_code,
)
from tierckpt_core.integrity import checksum, checksum_blocks
from tierckpt_core.manifest import FileRecord
from tierckpt_core.objectstore import StoreSettings
from tierckpt_core.objectstore.s3 import S3Store
from tierckpt_core.verified import (
    BlockStream,
    BlockSums,
    check_blocks,
    receive_into,
    receive_to,
)
from tierckpt_core.verified_copy import Copy, Pieces, copy_all, copy_verified

BLOCK = 16 << 10
LENGTH = 10 * BLOCK + 1234  # a short last block


def _file(length: int = LENGTH) -> tuple[bytes, BlockSums]:
    data = random.Random(length).randbytes(length)
    whole, size, blocks = checksum_blocks(memoryview(data))
    assert size == BLOCK
    rec = FileRecord(
        name="r0.data", rank=0, length=length, checksum=whole, block_size=size, blocks=blocks
    )
    return data, BlockSums.of(rec, where="job/step 3", source="from peer n2:7000")


def _reader(data: bytes, short_by: int = 0, piece: int = 7777) -> Callable[[memoryview, int], int]:
    """``read(view, offset)`` over ``data`` that hands out at most ``piece`` bytes at a time."""
    end = len(data) - short_by

    def read(view: memoryview, off: int) -> int:
        n = max(0, min(len(view), piece, end - off))
        view[:n] = data[off : off + n]
        return n

    return read


def _flipped(data: bytes, at: int) -> bytes:
    bad = bytearray(data)
    bad[at] ^= 0x01
    return bytes(bad)


def test_exact_bytes_land_from_a_stream() -> None:
    data, sums = _file()
    dest = bytearray(LENGTH)
    assert receive_into(_reader(data), memoryview(dest), sums, 0, chunk=5000) == LENGTH
    assert dest == data
    # a range of whole blocks in the middle, into a buffer of just that size
    lo, hi = sums.span(3 * BLOCK + 10, 5 * BLOCK + 1)
    part = bytearray(hi - lo)
    assert receive_into(_reader(data), memoryview(part), sums, lo) == hi - lo == 3 * BLOCK
    assert part == data[lo:hi]


@pytest.mark.parametrize("at", [0, BLOCK - 1, 4 * BLOCK + 99, LENGTH - 1])
def test_a_flipped_byte_in_any_block_fails_naming_file_block_and_source(at: int) -> None:
    data, sums = _file()
    with pytest.raises(BlockMismatchError) as err:
        receive_into(_reader(_flipped(data, at)), bytearray(LENGTH), sums, 0)
    e = err.value
    block = at // BLOCK
    assert (e.file, e.block, e.source) == ("r0.data", block, "from peer n2:7000")
    assert str(e) == (
        f"job/step 3: file r0.data from peer n2:7000 does not match the checksum taken when it was "
        f"written (block {block}, bytes {block * BLOCK}+{min(BLOCK, LENGTH - block * BLOCK)})"
    )
    assert isinstance(e, IntegrityError)  # what callers that handle any corruption catch
    with pytest.raises(BlockMismatchError, match=rf"\(block {block}, "):
        receive_to(_reader(_flipped(data, at)), lambda v, o: None, sums, 0, LENGTH)
    with pytest.raises(BlockMismatchError, match=rf"\(block {block}, "):
        check_blocks(_flipped(data, at), sums, 0)
    with pytest.raises(BlockMismatchError, match=rf"\(block {block}, "):
        copy_verified(_flipped(data, at), bytearray(LENGTH), sums, 0)


def test_a_short_stream_fails() -> None:
    data, sums = _file()
    with pytest.raises(
        PeerUnavailableError, match=r"file r0.data from peer n2:7000: bytes 0-.* ended"
    ):
        receive_into(
            _reader(data, short_by=1), bytearray(LENGTH), sums, 0, short=PeerUnavailableError
        )
    with pytest.raises(UnavailableError, match="ended after"):
        receive_to(_reader(data, short_by=BLOCK), lambda v, o: None, sums, 0, LENGTH)
    stream = BlockStream(sums, 0)
    stream.update(data[:-1])
    assert not stream.done and stream.checked == 10 * BLOCK  # the last block is never passed


def test_receive_from_a_socket_and_write_to_a_file(tmp_path: Path) -> None:
    data, sums = _file()
    a, b = socket.socketpair()

    def send() -> None:
        with a:
            a.sendall(data)

    sender = threading.Thread(target=send)
    sender.start()
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:

        def put(view: memoryview, off: int) -> None:
            os.pwrite(fd, view, off)

        with b:
            got = receive_to(lambda v, _off: b.recv_into(v), put, sums, 0, LENGTH, chunk=4096)
    finally:
        os.close(fd)
        sender.join()
    assert got == LENGTH and path.read_bytes() == data


def test_a_stream_in_pieces_of_any_size_and_a_restart() -> None:
    data, sums = _file()
    rng = random.Random(1)
    stream = BlockStream(sums, 2 * BLOCK, 6 * BLOCK)
    stream.update(b"garbage")  # a first attempt that a retry starts over
    stream.restart()
    off = 2 * BLOCK
    while off < 6 * BLOCK:
        n = min(rng.randint(1, 3 * BLOCK), 6 * BLOCK - off)
        stream.update(memoryview(data)[off : off + n])
        off += n
    assert stream.done and stream.checked == 4 * BLOCK
    with pytest.raises(ValueError, match="run past the end"):
        stream.update(b"x")
    with pytest.raises(ValueError, match="not whole blocks"):
        BlockStream(sums, 1, BLOCK)


@pytest.mark.parametrize("chunk", [4096, BLOCK, 1 << 20])
def test_copy_verified_lands_exact_bytes_of_any_range(chunk: int) -> None:
    data, sums = _file()
    for lo, hi in [(0, LENGTH), (BLOCK, 3 * BLOCK), (100, 5 * BLOCK + 7), (LENGTH - 5, LENGTH)]:
        dest = bytearray(hi - lo)
        checked = copy_verified(data, dest, sums, lo, chunk=chunk)
        assert dest == data[lo:hi]
        assert checked == sums.span(lo, hi)[1] - sums.span(lo, hi)[0]


def test_copy_verified_checks_the_edges_of_a_part() -> None:
    """A tensor covering part of a block: the whole block is checked, even the bytes it skips
    (before it and after it), and a bad byte in the part it lands."""
    data, sums = _file()
    for flip in (2 * BLOCK + 5, 2 * BLOCK + 150, 4 * BLOCK + 150):
        bad = _flipped(data, flip)  # before the part / in it, in its first / last block
        dest = bytearray(2 * BLOCK)
        block = flip // BLOCK
        with pytest.raises(BlockMismatchError, match=rf"\(block {block}, "):
            copy_verified(bad, dest, sums, 2 * BLOCK + 100)
    dest = bytearray(2 * BLOCK)
    copy_verified(data, dest, sums, 2 * BLOCK + 100)
    assert dest == data[2 * BLOCK + 100 : 4 * BLOCK + 100]


def test_a_file_without_block_checksums_is_one_block() -> None:
    data = b"abc" * 1000
    rec = FileRecord(name="r1.data", rank=1, length=len(data), checksum=checksum(data))
    sums = BlockSums.of(rec)
    assert check_blocks(data, sums, 0) == len(data)
    with pytest.raises(
        BlockMismatchError, match=r"file r1.data does not match .* \(block 0, bytes 0\+3000\)$"
    ):
        check_blocks(_flipped(data, 2999), sums, 0)
    with pytest.raises(IntegrityError, match="no checksum"):
        BlockSums.of(FileRecord(name="r1.data", rank=1, length=3))


def test_a_segment_checksummed_alone() -> None:
    data, _ = _file()
    seg = data[5000:5100]
    sums = BlockSums("r0.data", 100, 100, [checksum(seg).partition(":")[2]], origin=5000)
    assert check_blocks(seg, sums, 5000) == 100
    with pytest.raises(BlockMismatchError, match=r"\(block 0, bytes 5000\+100\)"):
        check_blocks(_flipped(seg, 3), sums, 5000)


def test_the_mismatch_pickles_whole_and_maps_back_from_its_code() -> None:
    e = BlockMismatchError("r0.data block 3", file="r0.data", block=3, source="from peer x")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is BlockMismatchError and str(back) == "r0.data block 3"
    assert (back.file, back.block, back.source) == ("r0.data", 3, "from peer x")
    assert type(error_from_code("block_mismatch", "d")) is BlockMismatchError


@pytest.mark.parametrize("threads", [3, 12])  # 12: more than 8 parts, larger pieces
@pytest.mark.parametrize("at", [None, 0, 5 * BLOCK + 3, LENGTH - 1])
def test_copy_verified_over_threads(
    monkeypatch: pytest.MonkeyPatch, at: int | None, threads: int
) -> None:
    """Split over threads at block boundaries: the same bytes land, and a bad block in any part
    fails the call (after every part stopped writing)."""
    monkeypatch.setattr(verified_copy, "PARALLEL_MIN", BLOCK)
    data, sums = _file()
    src = data if at is None else _flipped(data, at)
    dest = bytearray(LENGTH - 100)
    chunk = 5000 if threads == 3 else BLOCK  # pieces inside a block, and of whole blocks
    if at is None:
        assert copy_verified(src, dest, sums, 50, threads=threads, chunk=chunk) == LENGTH
        assert dest == data[50 : LENGTH - 50]
    else:
        with pytest.raises(BlockMismatchError, match=rf"\(block {at // BLOCK}, "):
            copy_verified(src, dest, sums, 50, threads=threads, chunk=chunk)


def test_the_store_does_not_retry_a_block_that_does_not_match() -> None:
    """A stored block that is wrong stays wrong: S3 retries a body cut short, not a mismatch."""
    store = S3Store("bucket", settings=StoreSettings(max_attempts=3))
    calls: list[str] = []

    def mismatch(d: object) -> None:
        calls.append("mismatch")
        raise BlockMismatchError("r0.data block 1", file="r0.data", block=1)

    def cut_short(d: object) -> None:
        calls.append("short")
        raise IntegrityError("r0.data ended at byte 5")

    with pytest.raises(BlockMismatchError):
        store._data_call("downloading", "r0.data", mismatch)
    with pytest.raises(IntegrityError, match="ended at byte 5"):
        store._data_call("downloading", "r0.data", cut_short)
    assert calls == ["mismatch"] + ["short"] * 3


# Python 3.12+ warns that fork() in a process with threads may deadlock: that is what is tested.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_copies_over_threads_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's threads stay in the parent: a child (a PROCESS-mode checkpoint) starts its own."""
    monkeypatch.setattr(verified_copy, "PARALLEL_MIN", BLOCK)
    data, sums = _file()
    copy_verified(data, bytearray(LENGTH), sums, 0, threads=2)  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if the copy over threads works here
        ok = False
        try:
            dest = bytearray(LENGTH)
            ok = copy_verified(data, dest, sums, 0, threads=2) == LENGTH and dest == data
        finally:
            os._exit(0 if ok else 1)
    deadline = time.monotonic() + 60  # a child waiting on the parent's threads never ends
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's copy over threads did not finish")
    assert os.waitstatus_to_exitcode(done[1]) == 0


def test_copy_all_reads_a_block_small_copies_share_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tensors side by side (several in one block) from a file read with ``read``, and a
    large one over threads: exact bytes land, each shared block is read (and checked) once, and
    a flipped byte in a shared block fails the call naming the block."""
    monkeypatch.setattr(verified_copy, "PARALLEL_MIN", BLOCK)
    data, sums = _file()
    reads: list[tuple[int, int]] = []
    read = _reader(data, piece=1 << 30)

    def counted(view: memoryview, off: int) -> int:
        reads.append((off, len(view)))
        return read(view, off)

    small = [(100 + 300 * i, 300) for i in range(10)]  # all in block 0
    spans = [*small, (BLOCK + 10, 6 * BLOCK)]  # blocks 1 and 7 in part, 2-6 whole
    dests = [bytearray(n) for _, n in spans]
    copies = [
        Copy(d, sums, at, read=counted, key="r0.data")
        for d, (at, _) in zip(dests, spans, strict=True)
    ]
    assert copy_all(copies, threads=3) == 3 * BLOCK + 5 * BLOCK
    assert all(d == data[at : at + n] for d, (at, n) in zip(dests, spans, strict=True))
    # Every byte read once: block 0 for the ten small copies (with block 1, the large copy's
    # first, in one chunk), and no block twice.
    assert sum(n for _, n in reads) == 8 * BLOCK
    assert sum(1 for off, n in reads if off <= 0 < off + n) == 1
    ends = sorted((off, off + n) for off, n in reads)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(ends))
    for flip in (200, 50, 3500):  # in a small copy's part; in the gaps before and after them
        dests = [bytearray(n) for _, n in small]
        for source in ({"src": _flipped(data, flip)}, {"read": _reader(_flipped(data, flip))}):
            with pytest.raises(BlockMismatchError, match=r"\(block 0, "):
                copy_all(
                    [
                        Copy(d, sums, at, key="r0.data", **source)  # type: ignore[arg-type]
                        for d, (at, _) in zip(dests, small, strict=True)
                    ]
                )
    dests = [bytearray(n) for _, n in small]
    copy_all(
        [
            Copy(d, sums, at, src=data, key="r0.data")
            for d, (at, _) in zip(dests, small, strict=True)
        ]
    )
    assert all(d == data[at : at + n] for d, (at, n) in zip(dests, small, strict=True))


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("how", ["src", "read"])
def test_small_copies_land_from_checked_chunks(
    monkeypatch: pytest.MonkeyPatch, threads: int, how: str
) -> None:
    """Hundreds of small copies side by side, some across a block's edge, some over the same
    bytes, beside a large one, with chunks of two blocks (so parts cross chunks too): exact
    bytes land; a flipped byte in any block fails the call naming it, and no copy that lies
    wholly in the chunk of that block gets a byte of it (checked before any is copied out)."""
    monkeypatch.setattr(verified_copy, "PARALLEL_MIN", BLOCK)
    monkeypatch.setattr(verified_copy, "CHUNK", 2 * BLOCK)
    data, sums = _file()
    rng = random.Random(7)
    spans = [(at, rng.randrange(1, 700)) for at in sorted(rng.sample(range(LENGTH - 700), 400))]
    spans += [(2 * BLOCK - 10, 20), (2 * BLOCK - 10, 20), (100, 5 * BLOCK)]  # the same bytes twice
    rng.shuffle(spans)

    def copies(src: bytes, dests: list[bytearray]) -> list[Copy]:
        source: dict[str, object] = {"src": src} if how == "src" else {"read": _reader(src)}
        return [
            Copy(d, sums, at, key="r0.data", **source)  # type: ignore[arg-type]
            for d, (at, _) in zip(dests, spans, strict=True)
        ]

    dests = [bytearray(n) for _, n in spans]
    assert copy_all(copies(data, dests), threads=threads) >= LENGTH  # every block, at least once
    assert all(d == data[at : at + n] for d, (at, n) in zip(dests, spans, strict=True))
    for flip in (5, 3 * BLOCK + 77, 6 * BLOCK + 1, LENGTH - 3):
        block = flip // BLOCK
        chunk_lo, chunk_hi = block // 2 * 2 * BLOCK, min(LENGTH, (block // 2 + 1) * 2 * BLOCK)
        dests = [bytearray(b"\xee" * n) for _, n in spans]
        with pytest.raises(BlockMismatchError, match=rf"\(block {block}, "):
            copy_all(copies(_flipped(data, flip), dests), threads=threads)
        for d, (at, n) in zip(dests, spans, strict=True):
            if chunk_lo <= at and at + n <= chunk_hi and n < BLOCK:
                assert d == b"\xee" * n, (at, n)


def _address(buf: bytearray) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) if buf else 0


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("how", ["src", "read"])
def test_pieces_land_by_address_from_checked_chunks(
    monkeypatch: pytest.MonkeyPatch, threads: int, how: str
) -> None:
    """Hundreds of small tensors of one file landed by address (``Pieces``), some across a
    block's edge, some of no bytes, beside a large copy sharing their blocks, with chunks of two
    blocks: exact bytes land, and not a byte beyond each piece; a flipped byte in any block
    fails the call naming it, and no piece wholly in that block's chunk gets a byte of it."""
    monkeypatch.setattr(verified_copy, "PARALLEL_MIN", BLOCK)
    monkeypatch.setattr(verified_copy, "CHUNK", 2 * BLOCK)
    data, sums = _file()
    rng = random.Random(11)
    spans = [(at, rng.randrange(0, 700)) for at in sorted(rng.sample(range(LENGTH - 700), 400))]
    spans += [(2 * BLOCK - 10, 20), (LENGTH - 5, 5), (0, BLOCK + 3)]
    large = (3 * BLOCK + 100, 4 * BLOCK)  # blocks 3 and 7 in part, 4-6 whole
    guard = b"\xee" * 8

    def run(src: bytes) -> tuple[list[bytearray], bytearray, int]:
        # Each piece's bytes between guards: a write past either end shows.
        bufs = [bytearray(guard + b"\xee" * n + guard) for _, n in spans]
        parts = [(at, n, _address(b) + len(guard)) for b, (at, n) in zip(bufs, spans, strict=True)]
        big = bytearray(large[1])
        source: dict[str, object] = {"src": src} if how == "src" else {"read": _reader(src)}
        checked = copy_all(
            [Copy(big, sums, large[0], key="r0.data", **source)],  # type: ignore[arg-type]
            threads=threads,
            pieces=[Pieces(sums, parts, **source)],  # type: ignore[arg-type]
        )
        return bufs, big, checked

    bufs, big, checked = run(data)
    assert checked >= large[1]
    assert big == data[large[0] : large[0] + large[1]]
    for b, (at, n) in zip(bufs, spans, strict=True):
        assert b == guard + data[at : at + n] + guard, (at, n)
    for flip in (5, 2 * BLOCK + 77, 7 * BLOCK + 1, LENGTH - 3):
        block = flip // BLOCK
        chunk_lo, chunk_hi = block // 2 * 2 * BLOCK, min(LENGTH, (block // 2 + 1) * 2 * BLOCK)
        with pytest.raises(BlockMismatchError, match=rf"\(block {block}, "):
            run(_flipped(data, flip))
        # (the bufs of the failed call are gone with it: run once more, keeping them)
        bufs = [bytearray(b"\xee" * n) for _, n in spans]
        parts = [(at, n, _address(b)) for b, (at, n) in zip(bufs, spans, strict=True)]
        with pytest.raises(BlockMismatchError):
            copy_all([], threads=threads, pieces=[Pieces(sums, parts, src=_flipped(data, flip))])
        for b, (at, n) in zip(bufs, spans, strict=True):
            if chunk_lo <= at and at + n <= chunk_hi:
                assert b == b"\xee" * n, (at, n)


def test_a_piece_outside_its_file_is_refused_before_any_byte_lands() -> None:
    data, sums = _file()
    buf = bytearray(b"\xee" * 16)
    for at, n in ((LENGTH - 8, 16), (-1, 4)):
        with pytest.raises(ValueError, match="outside"):
            copy_all([], pieces=[Pieces(sums, [(0, 16, _address(buf)), (at, n, 0)], src=data)])
    assert buf == b"\xee" * 16


def test_copy_all_from_a_read_that_ends_early_fails() -> None:
    data, sums = _file()
    dest = bytearray(LENGTH)
    with pytest.raises(IntegrityError, match="ended after"):
        copy_all([Copy(dest, sums, 0, read=_reader(data, short_by=10))])


@pytest.mark.parametrize("with_numpy", [True, False])
def test_copy_bytes_lands_every_byte_as_it_is(
    monkeypatch: pytest.MonkeyPatch, with_numpy: bool
) -> None:
    """The copy under every restore and every stage (numpy's vectorised loop in the client,
    Python's slice copy where numpy is missing): exact bytes, odd lengths and offsets included,
    and nothing written past the end."""
    if not with_numpy:
        monkeypatch.setitem(sys.modules, "numpy", None)  # import numpy fails
    monkeypatch.setattr(work_threads, "_COPY", None)  # chosen again, and put back after
    data = random.Random(7).randbytes(3 * BLOCK + 17)
    for at, n in [(0, len(data)), (1, 1), (3, 2 * BLOCK + 5), (BLOCK - 1, 0)]:
        dest = bytearray(b"\xa5" * (n + 9))
        work_threads.copy_bytes(memoryview(dest)[2 : 2 + n], memoryview(data)[at : at + n])
        assert dest[2 : 2 + n] == data[at : at + n]
        assert dest[:2] == b"\xa5\xa5" and dest[2 + n :] == b"\xa5" * 7


def test_copy_all_does_not_wait_for_a_worker_that_never_starts() -> None:
    """Every thread of the pool is held: the caller's thread lands and checks every block
    itself and returns, exact; the worker that never started is not waited for, and once free
    it writes nothing."""
    length = 2 * verified_copy.PARALLEL_MIN + 12345  # shared over threads
    data = random.Random(3).randbytes(length)
    whole, size, blocks = checksum_blocks(memoryview(data))
    rec = FileRecord(
        name="r0.data", rank=0, length=length, checksum=whole, block_size=size, blocks=blocks
    )
    sums = BlockSums.of(rec, where="job/step 3", source="in this node's memory")
    release = threading.Event()
    pool = work_threads.pool()
    held = [pool.submit(release.wait, 60) for _ in range(pool._max_workers)]
    dest = bytearray(length)
    done = threading.Event()
    try:
        threading.Thread(
            target=lambda: (copy_all([Copy(dest, sums, 0, src=data)], threads=4), done.set()),
            daemon=True,
        ).start()
        assert done.wait(30), "the copy waited for a worker that never started"
        assert dest == data
    finally:
        release.set()
        for f in held:
            f.result(timeout=60)
    pool.submit(lambda: None).result(timeout=60)  # every worker idle again
    assert dest == data


@pytest.mark.parametrize("threads", [1, 3])
def test_check_all_checks_blocks_in_place_over_threads(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The blocks a device copy reads, checked in the source beside it: all good blocks pass
    (the bytes counted), one flipped byte fails naming its block, whichever thread finds it."""
    monkeypatch.setattr(verified_copy, "PARALLEL_MIN", 2 * BLOCK)  # several runs
    monkeypatch.setattr(verified_copy, "GIL_HELD_MAX", 0)  # threads, for blocks this small
    data, sums = _file()
    blocks = [(data, sums, b) for b in range(len(sums.digests))]
    assert verified_copy.check_all(blocks, threads=threads) == LENGTH
    bad = _flipped(data, 7 * BLOCK + 5)
    with pytest.raises(BlockMismatchError) as e:
        verified_copy.check_all([(bad, sums, b) for b in range(11)], threads=threads)
    assert e.value.block == 7 and "r0.data" in str(e.value)
    assert verified_copy.check_all([(bad, sums, b) for b in (0, 1, 8, 10)], threads=threads) == (
        3 * BLOCK + 1234
    )


@pytest.mark.parametrize("length", [0, 1000, (4 << 20) + 7, (8 << 20) + 5, (20 << 20) + 123])
def test_checksum_beside_takes_the_checksums_of_one_pass(length: int) -> None:
    """The whole file hashed on another thread beside its blocks: the same checksums as one
    pass, whatever the block size (under 8 MiB the blocks are hashed holding the GIL: one
    pass); with a helper that starts at once, late, or never (cancelled: the whole hashed on
    the caller's thread)."""
    data = memoryview(random.Random(length).randbytes(length))
    want = checksum_blocks(data)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:

        def now(n: int, work: Callable[[], str]) -> list[concurrent.futures.Future[str]]:
            return [pool.submit(work) for _ in range(n)]

        assert integrity.checksum_beside(data, spawn=now) == want
    assert integrity.checksum_beside(data) == want  # no helper: one pass

    def never(n: int, work: Callable[[], str]) -> list[concurrent.futures.Future[str]]:
        return [concurrent.futures.Future() for _ in range(n)]  # a helper that never ran

    assert integrity.checksum_beside(data, spawn=never) == want


def test_checksum_beside_returns_only_once_its_helper_is_done() -> None:
    """A helper that has started is waited for, however slow (it reads the caller's buffer)."""
    data = memoryview(random.Random(1).randbytes((16 << 20) + 3))
    finished: list[float] = []

    def slow(n: int, work: Callable[[], str]) -> list[concurrent.futures.Future[str]]:
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()

        def run() -> None:
            time.sleep(0.3)
            out = work()
            finished.append(time.monotonic())
            fut.set_result(out)

        threading.Thread(target=run, daemon=True).start()
        return [fut]

    got = integrity.checksum_beside(data, spawn=slow)
    returned = time.monotonic()
    assert finished and finished[0] <= returned
    assert got == checksum_blocks(data)
