"""The stored files of one step as a reader sees them, whichever tier they come from.

A ``Files`` is what a read target's ``open_files`` yields: regions of files by name, offset and
length, read from this node's memory (mapped, or read with ``preadv`` when this process has not
mapped the file yet), from ranges of files other nodes hold (fetched and verified by the daemon),
or from whole files downloaded and verified from the persistent tier.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from tierckpt_client.dcp import _arena
from tierckpt_client.errors import CheckpointFormatError


class Files:
    """The stored files of one step, as ``region(file, offset, length)`` uint8 tensors, plus a
    faster way for whole tensors from a tier file this process has not mapped yet.

    A new mapping of a tier file costs a page-table entry per 4 KiB (``MAP_POPULATE``: ~0.3 s per
    GiB here, more than the copy), so the first restore after a hydration reads whole, contiguous
    destination tensors with ``preadv`` straight from the file instead. A file this process has
    mapped before (it saved the step, or restored it already) is copied from its mapping.
    """

    def __init__(
        self,
        where: str,
        load: Callable[[str], torch.Tensor],
        paths: dict[str, str],
        ranged: dict[str, dict[tuple[int, int], bytes]] | None = None,
    ) -> None:
        self.where = where
        self._load = load
        self._paths = paths  # empty: no local files (direct from the persistent tier)
        self._ranged = ranged or {}  # parts of files other nodes hold, fetched and verified
        self._buffers: dict[str, torch.Tensor] = {}
        self._fds: dict[str, int] = {}
        # Files of a step spanning nodes that this rank needed and that other nodes held.
        self.fetched: set[str] = set()

    def buffer(self, name: str) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            if self._paths and name not in self._paths:
                raise CheckpointFormatError(
                    f"{self.where}: metadata names file {name}, which the step does not have"
                )
            buf = self._buffers[name] = self._load(name)
        return buf

    def region(self, name: str, offset: int, length: int, what: str) -> torch.Tensor:
        if name in self._ranged:
            part = self._ranged[name].get((offset, length))
            if part is None:
                raise CheckpointFormatError(f"{self.where}: {what} of {name} was not fetched")
            return (
                torch.frombuffer(bytearray(part), dtype=torch.uint8)
                if length
                else torch.empty(0, dtype=torch.uint8)
            )
        buf = self.buffer(name)
        if offset + length > buf.numel():
            raise CheckpointFormatError(f"{self.where}: {what} lies beyond the end of {name}")
        return buf[offset : offset + length]

    def read_bytes(self, name: str, offset: int, length: int, what: str) -> bytes:
        if name in self._ranged:
            return self.region(name, offset, length, what).numpy().tobytes()
        fd = self._unmapped_fd(name)
        if fd is None:
            return self.region(name, offset, length, what).numpy().tobytes()
        self._check_range(fd, name, offset, length, what)
        return os.pread(fd, length, offset) if length else b""

    def read_into(self, name: str, offset: int, length: int, target: torch.Tensor) -> bool:
        """Read ``length`` bytes at ``offset`` of file ``name`` into ``target`` if that is the
        faster way (an unmapped tier file, a contiguous CPU target of that size); else False."""
        if (
            target.device.type != "cpu"
            or not target.is_contiguous()
            or target.numel() * target.element_size() != length
        ):
            return False
        fd = self._unmapped_fd(name)
        if fd is None:
            return False
        self._check_range(fd, name, offset, length, "a tensor")
        if not length:
            return True
        view = memoryview(target.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
        done = 0
        while done < length:
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointFormatError(f"{self.where}: {name} ended early")
            done += n
        return True

    def _unmapped_fd(self, name: str) -> int | None:
        """An open descriptor of tier file ``name`` if this process has no mapping of it."""
        path = self._paths.get(name)
        if path is None or name in self._buffers:
            return None
        fd = self._fds.get(name)
        if fd is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            if _arena.is_mapped(fd):
                os.close(fd)
                self.buffer(name)
                return None
            self._fds[name] = fd
        return fd

    def _check_range(self, fd: int, name: str, offset: int, length: int, what: str) -> None:
        if offset + length > os.fstat(fd).st_size:
            raise CheckpointFormatError(f"{self.where}: {what} lies beyond the end of {name}")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffers.clear()
