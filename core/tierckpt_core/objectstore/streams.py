"""Chunked streaming shared by every store and every copy loop: checksummed reads and writes in
``CHUNK_SIZE`` pieces, ``pwrite`` into a file, and an optional upload rate cap."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from tierckpt_core.errors import IntegrityError, PersistentTierError
from tierckpt_core.integrity import Hasher, open_regular

CHUNK_SIZE = 8 * 1024 * 1024
"""Bytes per read/write while streaming (also the CRT multipart part size)."""


def drain(
    chunks: Iterable[Any], size: int, put: Callable[[memoryview, int], None], where: str
) -> str:
    """Hand each chunk of a download to ``put(chunk, offset)``, checking that the chunks add up
    to ``size`` bytes; return their checksum."""
    h = Hasher()
    off = 0
    for chunk in chunks:
        view = memoryview(chunk)
        end = off + len(view)
        if end > size:
            raise IntegrityError(f"object {where} is larger than the expected {size} bytes")
        put(view, off)
        h.update(view)
        off = end
    if off != size:
        raise IntegrityError(f"object {where} has {off} bytes, expected {size}")
    return h.hexdigest()


def read_chunks(f: Any) -> Iterator[memoryview]:
    buf = memoryview(bytearray(CHUNK_SIZE))
    while n := f.readinto(buf):
        yield buf[:n]


def pwriter(fd: int) -> Callable[[memoryview, int], None]:
    """``put(view, offset)``: write all of ``view`` at ``offset`` of file ``fd`` (pwrite, looped)."""

    def put(view: memoryview, off: int) -> None:
        while view:
            n = os.pwrite(fd, view, off)
            view, off = view[n:], off + n

    return put


def as_bytes_view(dst: memoryview) -> memoryview:
    if dst.readonly:
        raise ValueError("get_into needs a writable buffer")
    return dst if dst.format == "B" and dst.ndim == 1 else dst.cast("B")


class RateLimiter:
    """Average-rate cap shared by every upload of one store (a token bucket of one chunk)."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"an upload rate must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def reserve(self, nbytes: int) -> float:
        """Book ``nbytes``; return how long to wait before sending them."""
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.bytes_per_s
        return start - now

    def acquire(self, nbytes: int) -> None:
        wait = self.reserve(nbytes)
        if wait > 0:
            time.sleep(wait)


def copy_stream(
    path: str,
    length: int | None,
    write: Callable[[bytes], Any],
    key: str,
    limiter: RateLimiter | None = None,
) -> str:
    """Stream the first ``length`` bytes of ``path`` to ``write`` in chunks; return the checksum."""
    h = Hasher()
    with open(open_regular(path), "rb", buffering=0) as src:
        remaining = os.fstat(src.fileno()).st_size if length is None else length
        if remaining < 0:
            raise ValueError(f"length must be >= 0, got {length}")
        while remaining > 0:
            chunk = src.read(min(CHUNK_SIZE, remaining))
            if not chunk:
                raise PersistentTierError(
                    f"uploading {key!r}: {path} ended {remaining} bytes short of the requested "
                    f"length {length}"
                )
            h.update(chunk)
            if limiter is not None:
                limiter.acquire(len(chunk))
            write(chunk)
            remaining -= len(chunk)
    return h.hexdigest()
