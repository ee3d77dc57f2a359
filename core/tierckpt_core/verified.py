"""One verified stream: the bytes of a stored file received or copied into a destination, each
block checked against the checksum taken when the file was written (``FileRecord.blocks``) as it
lands.

Every reader of bytes it does not trust uses it: the daemon receiving a peer's file into its tier,
a trainer receiving a peer's or the persistent tier's ranges into its tensors, a trainer copying
out of this node's memory tier (files the node's group can write). The bytes are hashed where they
landed, right after they landed, while they are still in the cache (one pass over memory, not
two), so what was checked is what the destination holds; a block that does not match raises
:class:`~tierckpt_core.errors.BlockMismatchError`, naming the file, the block, its bytes and the
source, before the call returns.

- :class:`BlockSums`: a file's block checksums, and how to name the file in an error.
- :class:`BlockStream`: a file's bytes arriving in order, in pieces of any size (for callers
  that are handed pieces, such as an object store's ``get_range`` callback).
- :func:`receive_into`: from a source that reads into a buffer (a socket, a file, an HTTP
  response) straight into a destination buffer.
- :func:`receive_to`: the same through one reused buffer, to a writer (``pwrite`` into a file).
- :func:`copy_all`: many :class:`Copy`, each from a buffer (a tier file's mapping) or a file read
  with ``preadv``, into its destination, hashing each piece of the destination right after it
  landed, the whole blocks of all of them shared by several threads; :func:`copy_verified` is
  one copy from a buffer.
- :func:`check_blocks`: bytes already in hand.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from tierckpt_core.errors import (
    BlockMismatchError,
    IntegrityError,
    TierCkptError,
    UnavailableError,
)
from tierckpt_core.integrity import ALGORITHM

if TYPE_CHECKING:  # only its fields are read: this module stays free of pydantic
    from tierckpt_core.manifest import FileRecord

CHUNK = 1 << 20
"""Bytes per piece received, copied and hashed: small enough to stay in a core's cache (1-2 MiB
of L2) between landing and being hashed; 8 MiB pieces cost a receiver 10-15% more CPU time."""

Read = Callable[[memoryview, int], int]
"""``read(view, offset)``: put the file's bytes from ``offset`` in a prefix of ``view``; how many
(0: the source ended). A socket ignores ``offset``; a file reads there (``os.preadv``)."""

Put = Callable[[memoryview, int], None]
"""``put(view, offset)``: keep all of ``view``, the file's bytes from ``offset``."""


@dataclass(frozen=True)
class BlockSums:
    """The block checksums of one stored file (``size`` bytes a block, the last one shorter), and
    what an error names: ``where`` (the step), ``source`` ("from peer X", "in the persistent
    tier") and ``remedy`` (what to do). ``origin``: the file offset of block 0 (a segment of a
    file checksummed alone)."""

    name: str
    length: int
    size: int
    digests: Sequence[str]
    where: str = ""
    source: str = ""
    remedy: str = ""
    origin: int = 0

    @classmethod
    def of(
        cls, rec: FileRecord, *, where: str = "", source: str = "", remedy: str = ""
    ) -> BlockSums:
        """The checksums of ``rec``: its blocks, else (a file saved without them) the whole file
        as one block. IntegrityError if it has neither."""
        if rec.blocks is not None and rec.block_size:
            return cls(rec.name, rec.length, rec.block_size, rec.blocks, where, source, remedy)
        algo, _, digest = (rec.checksum or "").partition(":")
        if algo != ALGORITHM or not digest:
            raise IntegrityError(
                f"{where + ': ' if where else ''}{rec.name} has no checksum to verify it against "
                "(committed by an older daemon?); restore the step from the persistent tier or a "
                "peer instead"
            )
        # xxh3-128 of the whole file is the digest of one block that spans it.
        return cls(rec.name, rec.length, max(rec.length, 1), [digest], where, source, remedy)

    @property
    def end(self) -> int:
        return self.origin + self.length

    def block_of(self, offset: int) -> int:
        return (offset - self.origin) // self.size

    def bounds(self, block: int) -> tuple[int, int]:
        """The file offsets ``[lo, hi)`` of ``block``."""
        lo = self.origin + block * self.size
        return lo, min(lo + self.size, self.end)

    def span(self, start: int, stop: int) -> tuple[int, int]:
        """The whole blocks around ``[start, stop)``."""
        if start < self.origin or stop > self.end or start > stop:
            raise ValueError(
                f"{self.name}: bytes {start}-{stop} are outside {self.origin}-{self.end}"
            )
        if start == stop:
            return start, stop
        return self.bounds(self.block_of(start))[0], self.bounds(self.block_of(stop - 1))[1]

    def mismatch(self, block: int) -> BlockMismatchError:
        lo, hi = self.bounds(block)
        return BlockMismatchError(
            f"{self.where + ': ' if self.where else ''}file {self.name}"
            f"{' ' + self.source if self.source else ''} does not match the checksum taken when it "
            f"was written (block {block}, bytes {lo}+{hi - lo})"
            f"{': ' + self.remedy if self.remedy else ''}",
            file=self.name,
            block=block,
            source=self.source or None,
        )

    def short(self, got: int, start: int, stop: int, error: type[TierCkptError]) -> TierCkptError:
        return error(
            f"{self.where + ': ' if self.where else ''}file {self.name}"
            f"{' ' + self.source if self.source else ''}: bytes {start}-{stop} ended after {got}"
        )

    def check(self, block: int, data: Any) -> None:
        """Block ``block`` is ``data`` (its whole bytes), else BlockMismatchError."""
        lo, hi = self.bounds(block)
        if len(data) != hi - lo or xxhash.xxh3_128(data).hexdigest() != self.digests[block]:
            raise self.mismatch(block)


class BlockStream:
    """Bytes ``[start, stop)`` of a file (whole blocks: ``stop`` on a block boundary or at the
    file's end) arriving in order: :meth:`update` hashes each piece and checks each block when its
    last byte arrives. Feed it the bytes where they landed, after they landed.

    Not thread-safe: one stream per transfer. A retried transfer calls :meth:`restart`."""

    def __init__(self, sums: BlockSums, start: int, stop: int | None = None) -> None:
        stop = sums.end if stop is None else stop
        lo, hi = sums.span(start, stop)
        if (lo, hi) != (start, stop):
            raise ValueError(f"{sums.name}: bytes {start}-{stop} are not whole blocks")
        self.sums = sums
        self.start = start
        self.stop = stop
        self._h = xxhash.xxh3_128()
        self.offset = start  # the next byte expected
        self.checked = 0  # bytes of the blocks checked

    def restart(self) -> None:
        """The transfer begins again at ``start``."""
        self._h.reset()
        self.offset = self.start
        self.checked = 0

    @property
    def done(self) -> bool:
        return self.offset == self.stop

    def update(self, piece: Any) -> None:
        """The next ``len(piece)`` bytes. BlockMismatchError when a block they end differs."""
        view = memoryview(piece).cast("B")
        n = len(view)
        if self.offset + n > self.stop:
            raise ValueError(
                f"{self.sums.name}: {n} bytes at {self.offset} run past the end ({self.stop})"
            )
        sums, pos = self.sums, 0
        while pos < n:
            block = sums.block_of(self.offset)
            lo, hi = sums.bounds(block)
            take = min(n - pos, hi - self.offset)
            self._h.update(view[pos : pos + take])
            pos += take
            self.offset += take
            if self.offset == hi:
                if self._h.hexdigest() != sums.digests[block]:
                    raise sums.mismatch(block)
                self.checked += hi - lo
                self._h.reset()


def _bytes(view: Any) -> memoryview:
    m = memoryview(view)
    return m if m.format == "B" and m.ndim == 1 else m.cast("B")


def receive_into(
    read: Read,
    dest: Any,
    sums: BlockSums,
    start: int,
    *,
    chunk: int = CHUNK,
    short: type[TierCkptError] = UnavailableError,
) -> int:
    """Bytes ``[start, start + len(dest))`` of the file (whole blocks) from ``read`` straight into
    ``dest``, each piece hashed in ``dest`` right after it landed and each block checked when it
    is complete. The bytes checked; BlockMismatchError, or ``short`` if the source ends early."""
    out = _bytes(dest)
    stream = BlockStream(sums, start, start + len(out))
    pos = 0
    while pos < len(out):
        n = read(out[pos : pos + min(chunk, len(out) - pos)], start + pos)
        if not n:
            raise sums.short(pos, start, start + len(out), short)
        stream.update(out[pos : pos + n])
        pos += n
    return stream.checked


def receive_to(
    read: Read,
    put: Put,
    sums: BlockSums,
    start: int,
    stop: int,
    *,
    chunk: int = CHUNK,
    short: type[TierCkptError] = UnavailableError,
) -> int:
    """Bytes ``[start, stop)`` of the file (whole blocks) from ``read`` to ``put``, through one
    reused buffer: each piece is hashed, then put, while it is in the cache; each block is checked
    when it is complete (``put`` has then had its bytes: a caller writing into a file it will
    serve must drop the file on error). The bytes checked; BlockMismatchError, or ``short``."""
    stream = BlockStream(sums, start, stop)
    buf = memoryview(bytearray(max(1, min(chunk, stop - start))))
    off = start
    while off < stop:
        n = read(buf[: min(len(buf), stop - off)], off)
        if not n:
            raise sums.short(off - start, start, stop, short)
        piece = buf[:n]
        stream.update(piece)
        put(piece, off)
        off += n
    return stream.checked


@dataclass(frozen=True)
class Copy:
    """Bytes ``[offset, offset + len(dest))`` of one stored file, to land in ``dest``: from
    ``src``, a buffer holding the file's bytes from ``sums.origin`` (a tier file's mapping), or
    else from ``read`` (``os.preadv`` on the file: no mapping, no page-table cost)."""

    dest: Any
    sums: BlockSums
    offset: int
    src: Any = None
    read: Read | None = None
    key: Any = None
    """Copies of one call with the same ``key`` (not None) read the same file: a block that
    several of them cover in part (small tensors side by side) is read and checked once."""


def copy_verified(
    src: Any, dest: Any, sums: BlockSums, offset: int, *, chunk: int = CHUNK, threads: int = 1
) -> int:
    """Copy bytes ``[offset, offset + len(dest))`` of the file whose bytes ``src`` holds (from
    ``sums.origin``: a tier file's mapping) into ``dest``, checking every block they touch: hash
    while copying, one pass over memory (see :func:`copy_all`). The bytes checked;
    BlockMismatchError."""
    return copy_all([Copy(dest, sums, offset, src=src)], chunk=chunk, threads=threads)


def copy_all(
    copies: Sequence[Copy],
    *,
    chunk: int = CHUNK,
    threads: int = 1,
    short: type[TierCkptError] = IntegrityError,
) -> int:
    """Land every :class:`Copy`, checking every block each touches: hash while copying, one pass
    over memory. Each piece of ``chunk`` bytes is hashed in ``dest`` right after it was copied or
    read there, while it is in the cache (the source may be shared memory that others can change:
    what was checked is what ``dest`` holds). A block a ``dest`` covers only in part is copied
    whole into a private buffer, checked there, and its part copied from it.

    ``threads`` > 1: the whole blocks of all the copies, cut into runs of about
    :data:`PARALLEL_MIN` bytes, are shared by that many workers (the caller's thread and threads
    of a shared pool; the copy, ``preadv`` and the hash all release the GIL), as torch's own copy
    uses several cores: one hand-over for a whole load, not one per tensor. Every worker is waited
    for: a block that does not match fails the call, never a later read, and nothing writes into
    a ``dest`` after the call returned. The bytes checked; BlockMismatchError (a bad block), or
    ``short`` when a ``read`` ends early."""
    landings = [_Landing(c, chunk, short) for c in copies]
    checked = _edges(landings)
    runs = [run for landing in landings for run in landing.runs(PARALLEL_MIN)]
    if not runs:
        return checked
    total = sum(hi - lo for _, lo, hi in runs)
    workers = min(threads, len(runs), max(1, total // PARALLEL_MIN))
    # Over many threads, pieces twice as large: each piece takes the GIL a few times between its
    # copy and its hash, and with 16 threads 1 MiB pieces spent more time waiting for it than 2
    # MiB ones (16 and 26 GB/s on a 16-core host; up to 8 threads 1 MiB was as fast or faster).
    piece = chunk if workers <= 8 else 2 * chunk
    todo = iter(runs)
    lock = threading.Lock()
    failed = threading.Event()

    def work() -> int:
        done = 0
        while not failed.is_set():
            with lock:
                run = next(todo, None)
            if run is None:
                break
            landing, lo, hi = run
            try:
                done += landing.whole(lo, hi, piece)
            except BaseException:
                failed.set()  # the others stop at their next run
                raise
        return done

    if workers <= 1:
        return checked + work()
    futures = [_pool().submit(work) for _ in range(workers - 1)]
    try:
        checked += work()
    finally:
        concurrent.futures.wait(futures)  # none may still write into a dest after this returns
    return checked + sum(f.result() for f in futures)  # a bad block's error


def _edges(landings: list[_Landing]) -> int:
    """Check the blocks each ``dest`` covers only in part in a private copy, and land their parts
    from it: once per block for all the copies of one ``key`` that cover it."""
    users: dict[tuple[Any, int], list[_Landing]] = {}
    for i, landing in enumerate(landings):
        key = landing.key if landing.key is not None else ("copy", i)
        for block in landing.partial():
            users.setdefault((key, block), []).append(landing)
    checked = 0
    for (_, block), them in users.items():
        first = them[0]
        lo, hi = first.sums.bounds(block)
        private = memoryview(bytearray(hi - lo))
        first.fetch(private, lo)
        first.sums.check(block, private)
        for landing in them:
            a, b = max(lo, landing.offset), min(hi, landing.stop)
            landing.out[a - landing.offset : b - landing.offset] = private[a - lo : b - lo]
        checked += hi - lo
    return checked


class _Landing:
    """One :class:`Copy` under way: its edges checked privately, its whole blocks by runs."""

    def __init__(self, c: Copy, chunk: int, short: type[TierCkptError]) -> None:
        self.sums, self.offset, self.chunk, self.short = c.sums, c.offset, chunk, short
        self.key = c.key
        self.out = _bytes(c.dest)
        self.stop = c.offset + len(self.out)
        self.src = _bytes(c.src) if c.src is not None else None
        self.read = c.read
        sums = c.sums
        if self.src is None and self.read is None:
            raise ValueError(f"{sums.name}: a copy needs a source (src or read)")
        too_short = self.src is not None and len(self.src) < sums.length
        if too_short or self.offset < sums.origin or self.stop > sums.end:
            raise ValueError(
                f"{sums.name}: bytes {self.offset}-{self.stop} of a "
                f"{len(self.src) if self.src is not None else 'read'}-byte source for "
                f"{sums.origin}-{sums.end}"
            )
        if self.offset == self.stop:
            self.inner = (self.offset, self.offset)
            return
        lo, hi = sums.span(self.offset, self.stop)
        # The whole blocks inside [offset, stop): landed and hashed in place. The blocks at
        # either edge, which dest covers only in part: checked in a private copy.
        self.inner = (
            lo if lo == self.offset else sums.bounds(sums.block_of(self.offset))[1],
            hi if hi == self.stop else sums.bounds(sums.block_of(self.stop - 1))[0],
        )

    def fetch(self, view: memoryview, at: int) -> None:
        """Bytes ``[at, at + len(view))`` of the file into ``view``."""
        if self.src is not None:
            _copy(view, self.src[at - self.sums.origin : at - self.sums.origin + len(view)])
            return
        assert self.read is not None
        got = 0
        while got < len(view):
            n = self.read(view[got:], at + got)
            if not n:
                raise self.sums.short(got, at, at + len(view), self.short)
            got += n

    def partial(self) -> list[int]:
        """The blocks ``dest`` covers only in part (none, one or two)."""
        if self.offset == self.stop:
            return []
        sums, (inner_lo, inner_hi) = self.sums, self.inner
        found = []
        for block in sorted({sums.block_of(self.offset), sums.block_of(self.stop - 1)}):
            lo, hi = sums.bounds(block)
            if not (inner_lo <= lo and hi <= inner_hi):
                found.append(block)
        return found

    def runs(self, about: int) -> list[tuple[_Landing, int, int]]:
        """The whole blocks inside, in runs of about ``about`` bytes (whole blocks each)."""
        lo, hi = self.inner
        if hi <= lo:
            return []
        per = max(1, about // self.sums.size) * self.sums.size
        return [(self, a, min(a + per, hi)) for a in range(lo, hi, per)]

    def whole(self, start: int, end: int, chunk: int) -> int:
        """Whole blocks ``[start, end)``, landed and checked piece by piece."""
        sums, out, offset = self.sums, self.out, self.offset
        if chunk < sums.size:  # pieces smaller than a block: a block's hash runs over several
            stream = BlockStream(sums, start, end)
            for at in range(start, end, chunk):
                piece = out[at - offset : min(at + chunk, end) - offset]
                self.fetch(piece, at)
                stream.update(piece)
            return stream.checked
        # Pieces of whole blocks, each block hashed in one call once its piece landed (xxh3's
        # one-shot call is faster than its streaming one).
        step, digests = chunk // sums.size * sums.size, sums.digests
        for at in range(start, end, step):
            upto = min(at + step, end)
            self.fetch(out[at - offset : upto - offset], at)
            for lo in range(at, upto, sums.size):
                block = sums.block_of(lo)
                got = xxhash.xxh3_128_hexdigest(
                    out[lo - offset : min(lo + sums.size, upto) - offset]
                )
                if got != digests[block]:
                    raise sums.mismatch(block)
        return end - start


PARALLEL_MIN = 8 << 20
"""Bytes of whole blocks one worker takes at a time; and below which a copy is not split over
threads (handing a run over costs ~50 us)."""

_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                min(16, os.cpu_count() or 1), thread_name_prefix="tierckpt-verify"
            )
        return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    # A forked child has none of the parent's threads, and the lock may have been held by one.
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _copier() -> Callable[[memoryview, memoryview], None]:
    """``copy(dest, src)`` of two equal byte views: numpy's, which releases the GIL (so copies
    in several threads run at once), where numpy is installed (the client); else Python's."""
    try:
        import numpy as np
    except ImportError:

        def assign(dest: memoryview, src: memoryview) -> None:
            dest[:] = src

        return assign

    def copyto(dest: memoryview, src: memoryview) -> None:
        np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(src, np.uint8))

    return copyto


_COPY: Callable[[memoryview, memoryview], None] | None = None


def _copy(dest: memoryview, src: memoryview) -> None:
    global _COPY
    if _COPY is None:  # numpy is imported on the first copy, not with the daemon
        _COPY = _copier()
    _COPY(dest, src)


def check_blocks(data: Any, sums: BlockSums, start: int) -> int:
    """``data`` is bytes ``[start, start + len(data))`` of the file (whole blocks), each block
    matching its checksum, else BlockMismatchError. The bytes checked."""
    stream = BlockStream(sums, start, start + len(_bytes(data)))
    stream.update(data)
    return stream.checked
