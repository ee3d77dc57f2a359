"""Checksums of stored files: xxh3-128, which hashes at memory bandwidth (tens of GB/s), so
verifying every byte read from the persistent tier or a peer costs little next to the transfer."""

from __future__ import annotations

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
