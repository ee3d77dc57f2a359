"""A step's files that this process reads itself: this node's memory, or whole downloads.

A ``LocalFiles`` is the ``StepFiles`` that the memory source (and the persistent tier without a
daemon) yields: regions of files by name, offset and length, read from this node's memory (mapped, or read with ``preadv`` when this process has not
mapped the file yet), from ranges of files other nodes hold (fetched and verified by the daemon),
or from whole files downloaded and verified from the persistent tier.

Every byte read from this node's memory is checked against the checksum taken when it was written
(``FileRecord.checksum`` and its per-block ``blocks``), block by block, each block once per load:
bytes items (which DCP unpickles) always, from a private copy that is verified before it is handed
on; tensors unless ``verify_tensors`` is off (``TIERCKPT_VERIFY_READS=0``). Ranges fetched from
other nodes and files downloaded from the persistent tier are verified where they are fetched.
"""

from __future__ import annotations

import errno
import functools
import os
from collections.abc import Callable
from typing import Any

import torch

from tierckpt_client.dcp import _arena
from tierckpt_client.dcp._device_copy import DeviceCopy, takes_bytes
from tierckpt_client.dcp._device_copy import land as land_on_device
from tierckpt_client.dcp._helpers import VERIFY, on_helpers, quiet_openmp
from tierckpt_client.dcp._metadata_codec import NUMPY_DTYPES, ShardRef
from tierckpt_core.errors import (
    BlockMismatchError,
    CheckpointFormatError,
    IntegrityError,
    UnavailableError,
)
from tierckpt_core.integrity import block_digest, checksum, open_regular
from tierckpt_core.manifest import FileRecord
from tierckpt_core.verified import BlockSums
from tierckpt_core.verified_copy import PARALLEL_MIN, Copy, Pieces, copy_all

_CHANGED = (
    "the copy in this node's memory changed; restore the step from the persistent tier or a peer"
)


MEMORY_SOURCE = "in this node's memory"  # BlockMismatchError.source of a local tier file


class LocalFiles:
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
        records: dict[str, FileRecord] | None = None,
        verify_tensors: bool = True,
        pin_memory: bool = False,
    ) -> None:
        self.where = where
        self._load = load
        self._paths = paths  # empty: no local files (direct from the persistent tier)
        self._ranged = ranged or {}  # parts of files other nodes hold, fetched and verified
        self._buffers: dict[str, torch.Tensor] = {}
        self._fds: dict[str, int] = {}
        self._records = records or {}  # the local files' checksums (required when _paths is set)
        self._verify_tensors = verify_tensors
        self._pin_memory = pin_memory  # register tier files a CUDA destination reads from
        self._verified: dict[str, set[int]] = {}  # blocks of each file checked so far
        self._sums: dict[str, BlockSums] = {}  # each local file's block checksums
        self._arrays: dict[str, Any] = {}  # each mapped file's bytes, as numpy sees them
        # Whole tensors landed and verified: (file, offset, length, the target's data_ptr).
        self._filled: set[tuple[str, int, int, int]] = set()
        self.verified_bytes = 0
        # Files of a step spanning nodes that this rank needed and that other nodes held.
        self.fetched: set[str] = set()

    prefetches = True  # the reader announces its whole tensors: they are copied all at once

    def prefetch(self, wants: list[tuple[ShardRef, torch.Tensor | None]]) -> None:
        """Land every whole tensor of a local file that ``wants`` puts in a contiguous CPU
        ``target``, verified, in one :func:`copy_all`: their blocks shared by torch's intra-op
        threads in one hand-over for the load, not one per tensor. A bad block fails this call,
        before the reader hands any tensor on. The rest is read when the reader asks."""
        if not self._verify_tensors:
            return  # DCP's copy out of the mapping, or one preadv per tensor, as asked
        jobs = []
        at: list[int] = []  # each job's target's address
        device: list[DeviceCopy] = []
        # Tensors smaller than a block, by file: (offset, length, the target's address).
        small: dict[str, list[tuple[int, int, int]]] = {}
        filled = self._filled
        for ref, target in wants:
            if target is None:
                continue
            name, offset, length, ptr = ref.file, ref.offset, ref.length, target.data_ptr()
            if (name, offset, length, ptr) in filled:
                continue
            if self._on_device(name, length, target):
                device.append(self._device_copy(name, offset, length, target))
                continue
            if not self._direct(name, length, target):
                continue
            sums = self._sums.get(name) or self._block_sums(name, offset, length)
            if 0 < length < sums.size:  # (no whole block: checked in a private copy)
                if offset + length > sums.length:
                    raise CheckpointFormatError(
                        f"{self.where}: a tensor lies beyond the end of {name}"
                    )
                small.setdefault(name, []).append((offset, length, ptr))
                continue
            job = self._copy(name, offset, length, target)
            if job is not None:
                jobs.append(job)
                at.append(ptr)
        self._land_on_device(device)
        self._land(jobs, at, [self._pieces(name, parts) for name, parts in small.items()])

    def _on_device(self, name: str, length: int, target: torch.Tensor) -> bool:
        """Whether CUDA tensor ``target`` takes ``length`` bytes of local file ``name`` as
        they are (a DMA out of its mapping, checked beside it: ``_device_copy``)."""
        return (
            bool(length)
            and takes_bytes(target, length)
            and name in self._paths
            and name not in self._ranged
        )

    def _device_copy(self, name: str, offset: int, length: int, target: torch.Tensor) -> DeviceCopy:
        buf = self.buffer(name)  # mapped: a device copy reads host memory
        if offset + length > buf.numel():
            raise CheckpointFormatError(f"{self.where}: a tensor lies beyond the end of {name}")
        rec = self._record(name, offset, length, "a tensor")
        sums = BlockSums.of(rec, where=self.where, remedy=_CHANGED)
        done = self._verified.get(name, set())
        lo, hi = sums.block_of(offset), sums.block_of(offset + length - 1)
        blocks = [b for b in range(lo, hi + 1) if b not in done]
        return DeviceCopy(buf, sums, offset, target, blocks)

    def _land_on_device(self, copies: list[DeviceCopy]) -> None:
        """Run the device copies, every block they read checked before this returns."""
        if not copies:
            return
        self.verified_bytes += land_on_device(copies, pin=self._pin_memory)
        for c in copies:
            n = c.target.numel() * c.target.element_size()
            self._filled.add((c.sums.name, c.offset, n, c.target.data_ptr()))
            self._verified.setdefault(c.sums.name, set()).update(c.blocks)

    def buffer(self, name: str) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None:
            if self._paths and name not in self._paths:
                raise CheckpointFormatError(
                    f"{self.where}: metadata names file {name}, which the step does not have"
                )
            try:
                buf = self._load(name)
            except OSError as e:
                self._raise_unopened(name, e)
                raise
            self._check_size(name, buf.numel())
            self._buffers[name] = buf
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
        if self._verify_tensors:
            self._verify(name, offset, length, what)
        return buf[offset : offset + length]

    def read_bytes(self, name: str, offset: int, length: int, what: str) -> bytes:
        """A private copy of a region, verified (DCP unpickles bytes items: never unverified
        bytes, and never bytes that could still change after they were checked)."""
        if name in self._ranged or not self._paths:  # verified where they were fetched
            return self.region(name, offset, length, what).numpy().tobytes()
        if not length:
            return b""
        rec = self._record(name, offset, length, what)
        size = _unit(rec)
        start = offset // size * size
        end = min(rec.length, -(-(offset + length) // size) * size)
        data = memoryview(bytes(self._read(name, start, end - start, what)))  # private
        for at in range(start, end, size):
            self._check_block(rec, at // size, data[at - start : min(at + size, end) - start])
        return bytes(data[offset - start : offset - start + length])

    def read_into(self, name: str, offset: int, length: int, target: torch.Tensor) -> bool:
        """Copy ``length`` bytes at ``offset`` of local file ``name`` into ``target`` (a
        contiguous CPU tensor of that size), checking them there; else False (the caller copies
        from :meth:`region`). True at once for what :meth:`prefetch` landed.

        Each piece is checked in ``target`` right after it landed there (the bytes are still in
        the cache, and ``target`` is this process's own memory, so what was checked is what the
        caller gets); a block the tensor covers only in part is copied whole into a private
        buffer (with its neighbours: one read for consecutive blocks small tensors share),
        checked there, and its part copied from it (:func:`copy_all`). The copy is
        ``preadv`` from a file this process has not mapped (no page-table cost), else out of
        the mapping.
        """
        if (name, offset, length, target.data_ptr()) in self._filled:
            return True
        if self._verify_tensors and self._on_device(name, length, target):
            self._land_on_device([self._device_copy(name, offset, length, target)])
            return True
        if not self._direct(name, length, target):
            return False
        if not self._verify_tensors:
            fd = self._unmapped_fd(name)
            if fd is None:
                return False  # DCP's copy out of the mapping is as fast
            self._check_range(fd, name, offset, length, "a tensor")
            flat: Any = target.reshape(-1).view(torch.uint8).numpy()
            self._pread_into(fd, name, memoryview(flat), offset)
            return True
        job = self._copy(name, offset, length, target)
        if job is not None:
            self._land([job], [target.data_ptr()])
        return True

    def _direct(self, name: str, length: int, target: torch.Tensor) -> bool:
        """Whether ``target`` takes ``length`` bytes of local file ``name`` as they are."""
        return (
            target.device.type == "cpu"
            and target.is_contiguous()
            and target.numel() * target.element_size() == length
            and name in self._paths
            and name not in self._ranged
        )

    def _copy(self, name: str, offset: int, length: int, target: torch.Tensor) -> Copy | None:
        """The verified copy of bytes ``[offset, offset + length)`` of ``name`` into ``target``:
        out of this process's mapping, else ``preadv`` from the file (None: no bytes)."""
        fd = self._unmapped_fd(name)
        if fd is not None:
            self._check_range(fd, name, offset, length, "a tensor")
        elif offset + length > self.buffer(name).numel():
            raise CheckpointFormatError(f"{self.where}: a tensor lies beyond the end of {name}")
        if not length:
            return None
        self._record(name, offset, length, "a tensor")  # (within the file's record)
        sums = self._sums.get(name) or self._block_sums(name, offset, length)
        dest = _as_array(target)
        # key: a block that small tensors side by side share is read and checked once per load.
        if fd is None:
            src = self._arrays.get(name)
            if src is None:
                src = self._arrays[name] = self.buffer(name).numpy()
            return Copy(dest, sums, offset, src=src, key=name)
        return Copy(dest, sums, offset, read=lambda view, at: os.preadv(fd, [view], at), key=name)

    def _land(self, jobs: list[Copy], at: list[int], pieces: list[Pieces] | None = None) -> None:
        """Run the copies (a bad block or a short file fails here, naming file and block);
        ``at``: the address of each one's target (the key of what was filled); ``pieces``:
        small tensors, by file (:meth:`_pieces`)."""
        pieces = pieces or []
        nbytes = sum(j.dest.nbytes for j in jobs) + sum(n for p in pieces for _, n, _ in p.parts)
        if not nbytes:
            return
        threads = torch.get_num_threads()
        if threads > 1 and nbytes >= 2 * PARALLEL_MIN:
            quiet_openmp()  # torch's spinning workers off the cores the copy's helpers take
        self.verified_bytes += copy_all(
            jobs,
            threads=threads,
            short=IntegrityError,  # a file that shrank since it was opened: damaged
            spawn=functools.partial(on_helpers, VERIFY),  # woken off this thread's core
            pieces=pieces,
        )
        filled = self._filled
        for job, ptr in zip(jobs, at, strict=True):
            sums, n = job.sums, job.dest.nbytes
            filled.add((sums.name, job.offset, n, ptr))
            done = self._verified.setdefault(sums.name, set())
            done.update(range(sums.block_of(job.offset), sums.block_of(job.offset + n - 1) + 1))
        for p in pieces:
            name, size = p.sums.name, p.sums.size
            done = self._verified.setdefault(name, set())
            for offset, length, ptr in p.parts:
                filled.add((name, offset, length, ptr))
                done.update(range(offset // size, (offset + length - 1) // size + 1))

    def _block_sums(self, name: str, offset: int, length: int) -> BlockSums:
        """Local file ``name``'s block checksums: one per file, not per tensor (thousands of
        tensors a load); ``offset`` and ``length``: the tensor that asks first."""
        rec = self._record(name, offset, length, "a tensor")
        sums = self._sums[name] = BlockSums.of(rec, where=self.where, remedy=_CHANGED)
        return sums

    def _pieces(self, name: str, parts: list[tuple[int, int, int]]) -> Pieces:
        """The small tensors of local file ``name`` to land: from this process's mapping, else
        ``preadv`` from the file (as :meth:`_copy`)."""
        sums = self._sums[name]
        fd = self._unmapped_fd(name)
        if fd is not None:
            self._check_range(fd, name, 0, sums.length, "its bytes")
            return Pieces(sums, parts, read=lambda view, at: os.preadv(fd, [view], at))
        if sums.length > self.buffer(name).numel():
            raise CheckpointFormatError(f"{self.where}: {name} ends before its record says")
        src = self._arrays.get(name)
        if src is None:
            src = self._arrays[name] = self.buffer(name).numpy()
        return Pieces(sums, parts, src=src)

    def _pread_into(self, fd: int, name: str, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise self._damaged(name, "ended early while it was read")
            done += n

    # -- verification ------------------------------------------------------------------------
    def _record(self, name: str, offset: int, length: int, what: str) -> FileRecord:
        rec = self._records.get(name)
        if rec is None or rec.checksum is None:
            raise IntegrityError(
                f"{self.where}: {name} has no checksum to verify {what} against (committed by an "
                "older daemon?); restore the step from the persistent tier or a peer instead"
            )
        if offset + length > rec.length:
            raise CheckpointFormatError(f"{self.where}: {what} lies beyond the end of {name}")
        return rec

    def _verify(self, name: str, offset: int, length: int, what: str) -> None:
        """Check the blocks of ``name`` that ``[offset, offset + length)`` touches, each once."""
        if not self._paths or not length:
            return
        rec = self._record(name, offset, length, what)
        size = _unit(rec)
        done = self._verified.setdefault(name, set())
        for i in range(offset // size, (offset + length - 1) // size + 1):
            if i not in done:
                n = min(size, rec.length - i * size)
                self._check_block(rec, i, memoryview(self._read(name, i * size, n, what)))

    def _check_block(self, rec: FileRecord, i: int, data: memoryview) -> None:
        """Block ``i`` of ``rec`` (the whole file when it has no block checksums) is ``data``."""
        if rec.blocks is not None and rec.block_size:
            good = block_digest(data) == rec.blocks[i]
        else:
            good = checksum(data) == rec.checksum
        if not good:
            raise BlockMismatchError(
                f"{self.where}: {rec.name} does not match the checksum taken when it was written "
                f"(block {i}, bytes {i * _unit(rec)}+{len(data)}): the copy in "
                "this node's memory changed; restore the step from the persistent tier or a peer",
                file=rec.name,
                block=i,
                source=MEMORY_SOURCE,
            )
        self._verified.setdefault(rec.name, set()).add(i)
        self.verified_bytes += len(data)

    def _read(self, name: str, offset: int, length: int, what: str) -> bytes | memoryview:
        """Bytes of a local file: a view of this process's mapping, else a private read."""
        fd = self._unmapped_fd(name)
        if fd is None:
            buf = self.buffer(name)
            if offset + length > buf.numel():
                raise CheckpointFormatError(f"{self.where}: {what} lies beyond the end of {name}")
            array: Any = buf[offset : offset + length].numpy()
            return memoryview(array).cast("B")
        self._check_range(fd, name, offset, length, what)
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise self._damaged(name, "ended early while it was read")
        return data

    def _unmapped_fd(self, name: str) -> int | None:
        """An open descriptor of tier file ``name`` if this process has no mapping of it."""
        path = self._paths.get(name)
        if path is None or name in self._buffers:
            return None
        fd = self._fds.get(name)
        if fd is None:
            try:  # a regular file only, never through a link, a FIFO opened at once
                fd = open_regular(path)
            except OSError as e:
                self._raise_unopened(name, e)
                raise
            if _arena.is_mapped(fd):
                os.close(fd)
                self.buffer(name)
                return None
            try:
                self._check_size(name, os.fstat(fd).st_size)
            except BaseException:
                os.close(fd)
                raise
            self._fds[name] = fd
        return fd

    def _raise_unopened(self, name: str, e: OSError) -> None:
        """Raise the damage tier file ``name`` that could not be opened shows, if it shows
        any: a step whose file is gone (its step directory still there), or was replaced by a
        link, a directory or anything else than a file, is damaged, like one whose bytes changed
        (a load of "latest" reads the next older step; the daemon is told). A step directory
        this process cannot see at all is a misconfigured trainer (the tier directory not
        mounted where the daemon says), not damage: an error saying so. Anything else (out of
        descriptors, ...): returns, for the caller to raise the OSError as it is."""
        if name not in self._paths:
            return
        if e.errno == errno.ENOENT and not os.path.isdir(os.path.dirname(self._paths[name])):
            raise UnavailableError(
                f"{self.where}: the daemon keeps it in {os.path.dirname(self._paths[name])}, "
                "which this process cannot see: is the daemon's tier directory "
                "(TIERCKPT_SHM_DIR) mounted at the same path in the trainer's container?"
            ) from e
        why = {
            errno.ENOENT: "is missing",
            errno.ELOOP: "was replaced by a symbolic link (not followed)",
            errno.ENODEV: "was replaced by something other than a regular file",
            errno.EISDIR: "was replaced by a directory",
        }.get(e.errno or 0)
        if why is not None:
            raise self._damaged(name, why) from None

    def _check_size(self, name: str, size: int) -> None:
        """A local tier file shorter than its record was cut short after it was written."""
        rec = self._records.get(name)
        if name in self._paths and rec is not None and size < rec.length:
            raise self._damaged(
                name, f"is {size} bytes, shorter than the {rec.length} it was written with"
            )

    def _damaged(self, name: str, why: str) -> BlockMismatchError:
        return BlockMismatchError(
            f"{self.where}: {name} in this node's memory {why}; restore the step from the "
            "persistent tier or a peer",
            file=name,
            source=MEMORY_SOURCE,
        )

    def _check_range(self, fd: int, name: str, offset: int, length: int, what: str) -> None:
        if offset + length > os.fstat(fd).st_size:
            rec = self._records.get(name)
            if rec is not None and offset + length <= rec.length:  # it was long enough at open
                raise self._damaged(name, "was cut short while it was read")
            raise CheckpointFormatError(f"{self.where}: {what} lies beyond the end of {name}")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._buffers.clear()
        self._filled.clear()


def _unit(rec: FileRecord) -> int:
    """The span one checksum of ``rec`` covers: a block, or the whole file when it has no blocks."""
    return rec.block_size if rec.blocks is not None and rec.block_size else rec.length


def _as_array(target: torch.Tensor) -> Any:
    """A numpy array over the bytes of contiguous CPU tensor ``target`` (keeping it alive), for
    a :class:`Copy`'s destination (which takes its bytes). Its own dtype where numpy has it: one
    call instead of three (``reshape``, ``view``, ``numpy``: ~3 us a tensor, thousands a load)."""
    if target.dtype in NUMPY_DTYPES:
        return target.numpy()
    return target.reshape(-1).view(torch.uint8).numpy()
