"""Checksums of stored files: xxh3-128, which hashes at memory bandwidth (tens of GB/s), so
verifying every byte read from the persistent tier or a peer costs little next to the transfer."""

from __future__ import annotations

import concurrent.futures
import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence

import xxhash

ALGORITHM = "xxh3_128"


class Hasher:
    """Incremental checksum; feed chunks in order, then :meth:`hexdigest`."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128()

    def update(self, chunk: bytes | bytearray | memoryview) -> None:
        self._h.update(chunk)

    def hexdigest(self) -> str:
        return f"{ALGORITHM}:{self._h.hexdigest()}"


def checksum(data: bytes | bytearray | memoryview) -> str:
    h = Hasher()
    h.update(data)
    return h.hexdigest()


READ_CHUNK = 8 * 1024 * 1024


def read_chunks(path: str, length: int, chunk_size: int = READ_CHUNK) -> Iterator[bytes]:
    """The first ``length`` bytes of the file at ``path``, in chunks; OSError if it is shorter
    or is not a regular file (:func:`open_regular`)."""
    fd = open_regular(path)
    with open(fd, "rb", buffering=0) as f:
        remaining = length
        while remaining > 0:
            chunk = f.read(min(chunk_size, remaining))
            if not chunk:
                raise OSError(f"{path} ended {remaining} bytes short of {length}")
            remaining -= len(chunk)
            yield chunk


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path``; OSError (``ELOOP``, ``ENODEV``)
    for a link or anything else. The daemon reads tier files, which others in its group could
    swap for links (``O_NOFOLLOW``) or FIFOs (``O_NONBLOCK``: opening one would wait for a
    writer; reads of a regular file ignore the flag)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.ENODEV, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def hashed_chunks(path: str, length: int, hasher: Hasher) -> Iterator[bytes]:
    """:func:`read_chunks`, feeding every chunk to ``hasher`` on the way (one read to send and
    checksum a file)."""
    for chunk in read_chunks(path, length):
        hasher.update(chunk)
        yield chunk


def checksum_file(path: str, length: int) -> str:
    """The checksum of the first ``length`` bytes of the file at ``path``."""
    h = Hasher()
    for _ in hashed_chunks(path, length, h):
        pass
    return h.hexdigest()


MIN_BLOCK = 16 << 10
MAX_BLOCKS = 1024
FEW_BLOCKS = 64
"""Files under 64 MiB have at most this many blocks: 16 KiB to 1 MiB each."""
LARGE_BLOCK = 1 << 20


def block_size(length: int) -> int:
    """The block size of a file of ``length`` bytes: a power of two, at least 16 KiB, with at
    most 64 blocks up to blocks of 1 MiB (a 64 MiB file), at most 1024 beyond (1 GiB: 1 MiB
    blocks; 4 GiB: 4 MiB).

    Blocks over 64 KiB (every file of 8 MiB or more) are hashed with the GIL released
    (python-xxhash hashes shorter inputs holding it), so several threads check them at once;
    until 2026-11-28 a file held up to 1024 blocks of at least 16 KiB whatever its size (a
    64 MiB file: 1024 blocks of 64 KiB, hashed one at a time however many threads copied them),
    and such records stay valid (:func:`check_digests`)."""
    size = MIN_BLOCK
    while size * MAX_BLOCKS < length or (size < LARGE_BLOCK and size * FEW_BLOCKS < length):
        size *= 2
    return size


def checksum_blocks(data: memoryview) -> tuple[str, int, list[str]]:
    """The checksum of ``data``, its block size and the checksum of each block (hex digests), in
    one pass: each block is hashed for the whole and for itself while it is in the cache."""
    whole = Hasher()
    size = block_size(len(data))
    blocks: list[str] = []
    for off in range(0, len(data), size):
        block = data[off : off + size]
        whole.update(block)
        blocks.append(block_digest(block))
    return whole.hexdigest(), size, blocks


def checksum_file_blocks(path: str, length: int) -> tuple[str, int, list[str]]:
    """:func:`checksum_blocks` of the first ``length`` bytes of ``path``: a peer can then send any
    range of the file in whole blocks that the receiver verifies one by one."""
    whole = Hasher()
    size = block_size(length)
    blocks: list[str] = []
    buf = bytearray(max(size, READ_CHUNK // size * size))  # whole blocks per read
    view = memoryview(buf)
    fd = open_regular(path)
    try:
        done = 0
        while done < length:
            want = min(len(buf), length - done)
            got = 0
            while got < want:
                n = os.preadv(fd, [view[got:want]], done + got)
                if n <= 0:
                    raise OSError(f"{path} ended {length - done - got} bytes short of {length}")
                got += n
            for off in range(0, want, size):
                block = view[off : min(off + size, want)]
                whole.update(block)
                blocks.append(block_digest(block))
            done += want
    finally:
        os.close(fd)
    return whole.hexdigest(), size, blocks


def check_digests(
    length: int, whole: str, size: int | None, blocks: list[str] | None
) -> str | None:
    """What is wrong with checksums claimed for a file of ``length`` bytes (the block ones may
    be absent together), or None."""
    if not whole.startswith(f"{ALGORITHM}:") or len(whole) != len(ALGORITHM) + 33:
        return f"checksum {whole[:48]!r} is not an {ALGORITHM} digest"
    if size is None and blocks is None:
        return None
    if size is None or blocks is None:
        return "block_size and blocks go together"
    # Any power of two from 16 KiB to this version's size with at most 1024 blocks: the sizes
    # earlier versions chose (up to 1024 blocks of 16 KiB and more) and this one's.
    most = block_size(length)
    if size & (size - 1) or not MIN_BLOCK <= size <= most or -(-length // size) > MAX_BLOCKS:
        return (
            f"block size {size} is not a power of two from {MIN_BLOCK} to {most} with at most "
            f"{MAX_BLOCKS} blocks for {length} bytes"
        )
    if len(blocks) != -(-length // size):
        return f"{len(blocks)} block checksums for {-(-length // size)} blocks"
    if any(len(b) != 32 for b in blocks):
        return "a block checksum is not a 32-digit hex digest"
    return None


def block_digest(data: bytes | bytearray | memoryview) -> str:
    return xxhash.xxh3_128(data).hexdigest()


GIL_HELD_MAX: int = getattr(getattr(xxhash, "_xxhash", None), "_GIL_MINSIZE", 65536)
"""xxhash hashes an input of at most this many bytes without releasing the GIL (python-xxhash:
``len > _GIL_MINSIZE`` releases it): blocks no larger (those of files under 8 MiB:
:func:`block_size`) are hashed one thread at a time however many threads take them, so
:func:`tierckpt_core.verified_copy.check_all` checks them on the caller's thread alone (more
threads would only hand the GIL around). Hashing them through ctypes, which releases the GIL
for the call, was tried and measured slower over 2 to 16 threads than one thread with
xxhash's call (docs/benchmarks.md, "The GIL-free block hash, measured on a quiet host")."""


def checksum_beside(
    data: memoryview,
    *,
    spawn: Callable[[int, Callable[[], str]], Sequence[concurrent.futures.Future[str]]]
    | None = None,
) -> tuple[str, int, list[str]]:
    """:func:`checksum_blocks` of ``data`` (the same checksums), the
    whole file hashed on another thread while this one hashes the blocks: both hashes release
    the GIL where the blocks are over :data:`GIL_HELD_MAX` (files of 8 MiB and more), so the two
    run at once. One pass hashes each block twice from the cache, one after the other (1 GiB:
    143 ms on the 2-core box, where this took 117: there the two threads share the memory's
    bandwidth). ``spawn(1, work)`` starts ``work`` on another thread (without: one pass on this
    one); a helper that has not started when the blocks are done is cancelled and the whole
    hashed here. Returns once no thread reads ``data``."""
    size = block_size(len(data))
    if spawn is None or size <= GIL_HELD_MAX:
        return checksum_blocks(data)

    def whole() -> str:
        h = Hasher()
        h.update(data)
        return h.hexdigest()

    (other,) = spawn(1, whole)
    try:
        blocks = [block_digest(data[at : at + size]) for at in range(0, len(data), size)]
    finally:
        if not other.cancel():
            concurrent.futures.wait([other])  # it reads data: never return before it is done
    return (whole() if other.cancelled() else other.result()), size, blocks
