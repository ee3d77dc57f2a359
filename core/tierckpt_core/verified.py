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
- :func:`~tierckpt_core.verified_copy.copy_all` (in :mod:`tierckpt_core.verified_copy`): many
  copies, each from a buffer (a tier file's mapping) or a file read with ``preadv``, into its
  destination, hashing each piece of the destination right after it landed, the whole blocks of
  all of them shared by several threads.
- :func:`check_blocks`: bytes already in hand.
"""

from __future__ import annotations

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


def check_blocks(data: Any, sums: BlockSums, start: int) -> int:
    """``data`` is bytes ``[start, start + len(data))`` of the file (whole blocks), each block
    matching its checksum, else BlockMismatchError. The bytes checked."""
    stream = BlockStream(sums, start, start + len(_bytes(data)))
    stream.update(data)
    return stream.checked
