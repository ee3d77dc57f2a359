"""The copying half of :mod:`tierckpt_core.verified`: stored bytes landed in destinations from a
buffer (a tier file's mapping) or a file read with ``preadv``, each piece hashed in its
destination right after it landed, the whole blocks of many copies shared by several threads.

- :class:`Copy`: one file's bytes to land in one destination.
- :class:`Pieces`: many small pieces of one file, each to land at an address (thousands of small
  tensors: no object per piece).
- :func:`copy_all`: many of them, checked; :func:`copy_verified`: one copy from a buffer.
- :func:`check_all`: blocks of buffers checked in place, over several threads (the bytes a
  device copy reads while they are checked).
"""

from __future__ import annotations

import bisect
import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from tierckpt_core.errors import IntegrityError, TierCkptError
from tierckpt_core.integrity import GIL_HELD_MAX
from tierckpt_core.threads import Spawn, copy_bytes, memmove, share
from tierckpt_core.verified import CHUNK, BlockStream, BlockSums, Read, _bytes


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


@dataclass(frozen=True)
class Pieces:
    """Pieces of one stored file, each ``(offset, length, address)``: bytes ``[offset, offset +
    length)`` to land at ``address``, the start of ``length`` writable bytes of this process's
    memory that stay valid for the call (a contiguous tensor's ``data_ptr()``, the tensor held by
    the caller). From ``src`` or ``read`` as :class:`Copy`. Each piece is checked as a copy
    covering its blocks only in part is (:class:`_Edges`): for thousands of small tensors of one
    file a tuple each, not an object and a buffer view each (~10 us a tensor less on the 2-core
    box). Pieces that land at one address (tied weights) leave the bytes of one of them there."""

    sums: BlockSums
    parts: Sequence[tuple[int, int, int]]
    src: Any = None
    read: Read | None = None


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
    spawn: Spawn | None = None,
    pieces: Sequence[Pieces] = (),
) -> int:
    """Land every :class:`Copy` and every piece of ``pieces``, checking every block each touches: hash while copying, one pass
    over memory. Each piece of ``chunk`` bytes is hashed in ``dest`` right after it was copied or
    read there, while it is in the cache (the source may be shared memory that others can change:
    what was checked is what ``dest`` holds). The blocks a ``dest`` covers only in part are
    checked as :class:`_Edges` says: read into private memory, checked there, then copied out.

    ``threads`` > 1: the whole blocks of all the copies, cut into runs of about
    :data:`PARALLEL_MIN` bytes, and the blocks covered in part, are shared by that many workers
    (the caller's thread and threads of a shared pool; the copy, ``preadv`` and the hash of a
    block over 64 KiB release the GIL), as torch's own copy uses several cores: one hand-over
    for a whole load, not one per tensor. Every worker that started is waited for: a block that
    does not match fails the call, never a later read, and nothing writes into a ``dest`` after
    the call returned; a worker that has not started when the caller's thread is done (every run
    taken) is cancelled, not waited for. ``spawn(n, work)`` starts ``work`` on ``n`` other
    threads (default: a pool of this module's; the client's keeps them off the caller's core).
    The bytes checked; BlockMismatchError (a bad block), or ``short`` when a ``read`` ends
    early."""
    views: dict[int, memoryview] = {}  # each source's bytes, made once for all its copies
    landings = [_Landing(c, chunk, short, views) for c in copies]
    edges = _Edges.of(landings, [_Landing.of_pieces(p, chunk, short, views) for p in pieces])
    runs: list[Any] = [run for landing in landings for run in landing.runs(PARALLEL_MIN)]
    total = sum(hi - lo for _, lo, hi in runs) + edges.bytes
    runs.extend(edges.runs(PARALLEL_MIN))
    if not runs:
        return 0
    workers = min(threads, len(runs), max(1, total // PARALLEL_MIN))
    # Over many threads, pieces twice as large: each piece takes the GIL a few times between its
    # copy and its hash, and with 16 threads 1 MiB pieces spent more time waiting for it than 2
    # MiB ones; up to 8 threads 1 MiB was as fast or faster (docs/benchmarks.md, "Figures
    # behind the code's choices").
    piece = chunk if workers <= 8 else 2 * chunk

    def land(run: Any) -> int:
        if type(run) is list:  # chunks of blocks covered in part
            return _Edges.land(run)
        landing, lo, hi = run
        return int(landing.whole(lo, hi, piece))

    return share(runs, workers, land, spawn)


# File bytes [lo, hi) of one copy in blocks it covers in part, or of a piece: the address of lo.
_Part = tuple[int, int, "_Landing | int"]
_Chunk = tuple["_Landing", int, int, list[_Part]]  # read by, file bytes [lo, hi), its parts


class _Edges:
    """The blocks copies cover only in part (small tensors side by side, and the first and last
    block of larger ones), for all the copies of one ``key`` (one file) together: consecutive
    such blocks are read in chunks of about :data:`CHUNK` bytes into private memory (one copy or
    ``preadv`` per chunk, not one per block or per tensor), every block of the chunk is checked
    there, and each copy's part is copied out of it. Private memory: what was checked is what
    each ``dest`` gets, whoever can write into the source; a bad block fails the call before
    any byte of its chunk is copied out. Thousands of tensors of a few KiB: one copy out of a
    chunk each, in place of the per-block hashing across each tensor's bytes where they landed
    (docs/benchmarks.md, "Thousands of tensors")."""

    def __init__(self, chunks: list[_Chunk]) -> None:
        self.chunks = chunks
        self.bytes = sum(hi - lo for _, lo, hi, _ in chunks)

    @classmethod
    def of(
        cls, landings: list[_Landing], pieces: Sequence[tuple[_Landing, list[_Part]]] = ()
    ) -> _Edges:
        """``pieces``: each a reader of one file (a copy of no bytes) and its pieces."""
        by_key: dict[Any, tuple[_Landing, list[_Part]]] = {}
        for i, landing in enumerate(landings):
            parts = landing.edge_parts()
            if parts:
                key = landing.key if landing.key is not None else ("copy", i)
                by_key.setdefault((key, id(landing.sums)), (landing, []))[1].extend(parts)
        chunks: list[_Chunk] = []
        for reader, parts in (*by_key.values(), *pieces):
            if parts:
                chunks.extend(_chunks_of(reader, parts))
        return cls(chunks)

    def runs(self, about: int) -> list[list[_Chunk]]:
        """The chunks in runs of about ``about`` bytes, in file order."""
        runs: list[list[_Chunk]] = []
        size = about
        for c in self.chunks:
            if size >= about:
                runs.append([])
                size = 0
            runs[-1].append(c)
            size += c[2] - c[1]
        return runs

    @staticmethod
    def land(run: list[_Chunk]) -> int:
        raw = bytearray(max(hi - lo for _, lo, hi, _ in run))
        buf = memoryview(raw)
        base = ctypes.addressof(ctypes.c_char.from_buffer(raw))  # (pieces land by address)
        for reader, lo, hi, parts in run:
            private = buf[: hi - lo]
            reader.fetch(private, lo)
            sums = reader.sums
            for block in range(sums.block_of(lo), sums.block_of(hi - 1) + 1):
                a, b = sums.bounds(block)
                sums.check(block, private[a - lo : b - lo])
            for start, stop, to in parts:
                a, b = max(start, lo), min(stop, hi)
                if isinstance(to, int):  # a piece: its bytes from ``start`` at address ``to``
                    memmove(to + a - start, base + a - lo, b - a)
                else:
                    to.out[a - to.offset : b - to.offset] = private[a - lo : b - lo]
        return sum(hi - lo for _, lo, hi, _ in run)


def _chunks_of(reader: _Landing, parts: list[_Part]) -> list[_Chunk]:
    """The chunks of the blocks ``parts`` (of the file ``reader`` reads) touch: runs of
    consecutive blocks of at most :data:`CHUNK` bytes (at least one block), each with the parts
    that overlap it."""
    sums = reader.sums
    blocks = sorted({b for lo, hi, _ in parts for b in (sums.block_of(lo), sums.block_of(hi - 1))})
    per = max(1, CHUNK // sums.size)  # blocks a chunk
    spans: list[list[int]] = []  # [first block, last block]
    for b in blocks:
        if spans and b == spans[-1][1] + 1 and b - spans[-1][0] < per:
            spans[-1][1] = b
        else:
            spans.append([b, b])
    starts = [sums.bounds(first)[0] for first, _ in spans]
    chunks: list[_Chunk] = [
        (reader, lo, sums.bounds(last)[1], [])
        for (first, last), lo in zip(spans, starts, strict=True)
    ]
    for part in parts:
        lo, hi, _ = part
        for i in range(bisect.bisect_right(starts, lo) - 1, bisect.bisect_left(starts, hi)):
            chunks[i][3].append(part)
    return chunks


class _Landing:
    """One :class:`Copy` under way: its edges checked privately, its whole blocks by runs."""

    def __init__(
        self, c: Copy, chunk: int, short: type[TierCkptError], views: dict[int, memoryview]
    ) -> None:
        self.sums, self.offset, self.chunk, self.short = c.sums, c.offset, chunk, short
        self.key = c.key
        self.out = _bytes(c.dest)
        self.stop = c.offset + len(self.out)
        self.src = None
        if c.src is not None:  # (kept by id for the call: every copy holds its source alive)
            self.src = views.get(id(c.src))
            if self.src is None:
                self.src = views[id(c.src)] = _bytes(c.src)
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
        # The whole blocks inside [offset, stop): landed and hashed in place. The blocks at
        # either edge, which dest covers only in part: checked in a private copy (_Edges).
        # (sums.span and sums.bounds, inline: thousands of small copies make one call each.)
        size, origin, end = sums.size, sums.origin, sums.end
        first = origin + (self.offset - origin) // size * size  # where the first block starts
        last = origin + (self.stop - 1 - origin) // size * size  # and the last
        self.inner = (
            self.offset if first == self.offset else min(first + size, end),
            self.stop if min(last + size, end) == self.stop else last,
        )

    @classmethod
    def of_pieces(
        cls, p: Pieces, chunk: int, short: type[TierCkptError], views: dict[int, memoryview]
    ) -> tuple[_Landing, list[_Part]]:
        """A reader of ``p``'s file (a copy of no bytes), and ``p``'s parts."""
        sums = p.sums
        reader = cls(Copy(b"", sums, sums.origin, src=p.src, read=p.read), chunk, short, views)
        origin, end = sums.origin, sums.end
        parts: list[_Part] = []
        for offset, length, address in p.parts:
            if offset < origin or offset + length > end or length < 0:
                raise ValueError(f"{sums.name}: bytes {offset}+{length} outside {origin}-{end}")
            if length:
                parts.append((offset, offset + length, address))
        return reader, parts

    def fetch(self, view: memoryview, at: int) -> None:
        """Bytes ``[at, at + len(view))`` of the file into ``view``."""
        if self.src is not None:
            copy_bytes(view, self.src[at - self.sums.origin : at - self.sums.origin + len(view)])
            return
        assert self.read is not None
        got = 0
        while got < len(view):
            n = self.read(view[got:], at + got)
            if not n:
                raise self.sums.short(got, at, at + len(view), self.short)
            got += n

    def edge_parts(self) -> list[_Part]:
        """The bytes of ``dest`` in blocks it covers only in part: all of them where it covers
        no block whole, else the bytes before and after its whole blocks (none, one or two)."""
        lo, hi = self.inner
        if hi <= lo:
            return [(self.offset, self.stop, self)] if self.offset < self.stop else []
        parts: list[_Part] = []
        if self.offset < lo:
            parts.append((self.offset, lo, self))
        if hi < self.stop:
            parts.append((hi, self.stop, self))
        return parts

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


def check_all(
    blocks: Sequence[tuple[Any, BlockSums, int]],
    *,
    threads: int = 1,
    spawn: Spawn | None = None,
) -> int:
    """Check each ``(src, sums, block)``: the bytes of ``block`` in ``src`` (a buffer holding
    the file from ``sums.origin``: a tier file's mapping) against its checksum, the blocks shared
    by up to ``threads`` workers in runs of about :data:`PARALLEL_MIN` bytes, as
    :func:`copy_all` shares its copies. For a copy that reads ``src`` itself while the blocks
    are checked (a DMA to a device, ``dcp/_device_copy``): what is checked is ``src``, not the
    destination. Blocks of at most :data:`GIL_HELD_MAX` bytes are checked on the caller's thread
    alone. Every worker that started is waited for. The bytes checked; BlockMismatchError (a
    bad block)."""
    if all(sums.size <= GIL_HELD_MAX for _, sums, _ in blocks):
        # xxhash's own call holds the GIL for these: no thread would hash beside another, and
        # the same C function through ctypes (which releases it) handed the GIL around every
        # 64 KiB block: slower over 2 to 16 threads than one (docs/benchmarks.md).
        threads = 1
    runs: list[list[tuple[memoryview, BlockSums, int]]] = []
    size = 0
    for src, sums, block in blocks:
        if not runs or size >= PARALLEL_MIN:
            runs.append([])
            size = 0
        lo, hi = sums.bounds(block)
        runs[-1].append((_bytes(src), sums, block))
        size += hi - lo
    if not runs:
        return 0

    def check(run: list[tuple[memoryview, BlockSums, int]]) -> int:
        done = 0
        for view, sums, block in run:
            lo, hi = sums.bounds(block)
            got = xxhash.xxh3_128_hexdigest(view[lo - sums.origin : hi - sums.origin])
            if got != sums.digests[block]:
                raise sums.mismatch(block)
            done += hi - lo
        return done

    return share(runs, min(threads, len(runs)), check, spawn)


PARALLEL_MIN = 8 << 20
"""Bytes of whole blocks one worker takes at a time; and below which a copy is not split over
threads (handing a run over costs a thread wake-up)."""
