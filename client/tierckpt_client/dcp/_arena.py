"""Per-process mappings of the daemon's shared-memory files, and how staged tensors cross processes.

**Mapping cache.** Copying into tmpfs pages through a mapping that is already open and touched runs
at memcpy speed; a new mapping of the same pages pays a page fault per 4 KiB. The daemon recycles
files (same inode) for the next step of the same size, so this module keeps one mapping per file
identity ``(st_dev, st_ino)`` for the life of the process and hands it out again. A mapping is
dropped from the cache once its file is deleted (``st_nlink == 0``); its memory goes away when the
last tensor that aliases it does.

**Pickling.** DCP's PROCESS mode pickles the staged state dict into a helper process with torch's
``ForkingPickler``, which would move each storage into a new shared-memory segment (a full copy) or
fail for storages that alias a file mapping. :func:`install_pickle_reducer` registers a reducer for
``torch.UntypedStorage`` (and one for ``DTensor`` that pickles its local tensor and spec rather than
the wrapper) that sends storages inside a cached mapping as a reference
``(pid, fd, dev, ino, offset, nbytes)``; the helper re-opens the same file through
``/proc/<pid>/fd/<fd>`` (stable across the daemon's renames) and maps it, again through its own
cache. Every other storage is handed to torch's reducer unchanged.

**Pinning for CUDA.** A copy between a GPU and pageable host memory goes through the driver's
staging buffers at a fraction of the link's speed; into or out of page-locked memory it is a DMA.
:func:`pin` registers a cached mapping's pages with ``cudaHostRegister`` (once: the mapping lives as
long as the daemon recycles its file, so the cost, a few hundred ms per GiB, is paid on the first
saves of a run only), and :func:`_forget` unregisters it when the file goes away. The pages are the
daemon's tier file: no second host copy, unlike a pinned staging buffer beside the tier.
"""

from __future__ import annotations

import bisect
import errno
import logging
import mmap
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tierckpt_core.errors import CheckpointFormatError

logger = logging.getLogger(__name__)

_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


@dataclass(eq=False)
class FileMapping:
    """One shared mapping of a whole tier file; ``buffer`` is a uint8 tensor over all of it."""

    dev: int
    ino: int
    fd: int
    size: int
    buffer: torch.Tensor
    pinned: bool = False  # registered with CUDA as page-locked memory (see pin())
    pin_failed: bool = False  # registering it failed once: not tried again
    _typed: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)
    _placed: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    @property
    def base(self) -> int:
        return int(self.buffer.data_ptr())

    def view(self, offset: int, length: int) -> torch.Tensor:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise CheckpointFormatError(
                f"byte range [{offset}, {offset + length}) is outside a {self.size}-byte tier file"
            )
        return self.buffer[offset : offset + length]

    def placed(self, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """:meth:`tensor_at`, the same tensor object again where the last one asked for at
        ``offset`` had this dtype and shape: a save of an unchanged layout into a file it staged
        into before (the daemon hands a rank back its own files) finds every tensor ready, ~5 us
        a tensor less on the stall of thousands of them. Kept by offset and checked for dtype
        and shape on every use, so a changed layout gets new tensors, never a wrong one. (A
        tensor made during a save inside ``torch.inference_mode()`` is a view of the buffer,
        made outside it: not an inference tensor, so later saves outside it copy into it.)"""
        hit = self._placed.get(offset)
        if hit is not None and hit.dtype == dtype and hit.shape == shape:
            return hit
        if len(self._placed) >= _PLACED_MAX:
            self._placed.clear()  # layouts that keep changing: keep the newest
        made = self._placed[offset] = self.tensor_at(offset, dtype, shape)
        return made

    def tensor_at(self, offset: int, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        """A contiguous ``dtype`` tensor of ``shape`` over the bytes at ``offset``: the same as
        ``view(offset, nbytes).view(dtype).view(shape)``, in one ``as_strided`` of a typed view
        of the whole buffer (made once per dtype): a third of the per-tensor cost of staging a
        state dict of many small tensors."""
        itemsize = dtype.itemsize
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * itemsize
        typed = self._typed.get(dtype) if offset % itemsize == 0 else None
        if typed is None and offset % itemsize == 0 and self.size % itemsize == 0:
            with torch.inference_mode(False):  # (as the buffer: see _new_mapping)
                typed = self._typed[dtype] = self.buffer.view(dtype)
        if typed is None:
            return self.view(offset, nbytes).view(dtype).view(shape)
        if offset < 0 or offset + nbytes > self.size:
            raise CheckpointFormatError(
                f"byte range [{offset}, {offset + nbytes}) is outside a {self.size}-byte tier file"
            )
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * max(shape[i + 1], 1)
        return torch.as_strided(typed, shape, strides, offset // itemsize)


_PLACED_MAX = 1 << 16
"""Tensors :meth:`FileMapping.placed` keeps per file at most (a few MiB of tensor objects)."""

_lock = threading.Lock()
_by_identity: dict[tuple[int, int], FileMapping] = {}
_bases: list[int] = []  # sorted base addresses, parallel to _by_base
_by_base: list[FileMapping] = []


def map_file(path: str, *, follow: bool = False) -> FileMapping:
    """Map ``path`` (read-write, shared), reusing this process's mapping of the same file if any.

    A tier file is opened with ``O_NOFOLLOW`` (OSError ``ELOOP`` on a link): every process of
    the daemon's group can replace entries of the tier directory, and a link planted in place of
    a leased file would have this process write a save's bytes into whatever it points at
    (docs/security.md). ``follow``: only for ``/proc/<pid>/fd/<fd>``, which is a link by nature.
    A path that is not a regular file is an OSError (``ENODEV``) too."""
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.ENODEV, "not a regular file", path)
        key = (st.st_dev, st.st_ino)
        with _lock:
            hit = _by_identity.get(key)
            if hit is not None and hit.size == st.st_size:
                return hit
            if hit is not None:
                _forget(hit)
            mapping = _new_mapping(fd, st.st_dev, st.st_ino, st.st_size)
            fd = -1  # owned by the mapping now
            _by_identity[key] = mapping
            i = bisect.bisect(_bases, mapping.base)
            _bases.insert(i, mapping.base)
            _by_base.insert(i, mapping)
            _prune_deleted()
            return mapping
    finally:
        if fd >= 0:
            os.close(fd)


def _new_mapping(fd: int, dev: int, ino: int, size: int) -> FileMapping:
    # Never an inference tensor, whatever mode the first save that maps the file runs in: torch
    # refuses in-place updates of those outside inference mode, and later saves copy into it.
    with torch.inference_mode(False):
        if size == 0:
            buf = torch.empty(0, dtype=torch.uint8)
        else:
            mm = mmap.mmap(fd, size, flags=_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            buf = torch.frombuffer(mm, dtype=torch.uint8)  # holds mm alive while views exist
    return FileMapping(dev=dev, ino=ino, fd=fd, size=size, buffer=buf)


def _forget(m: FileMapping) -> None:
    if m.pinned:
        err = _cuda_host_unregister(m.base)
        if err:
            logger.warning("could not unregister a pinned tier file (CUDA error %d)", err)
        m.pinned = False
    _by_identity.pop((m.dev, m.ino), None)
    for i, other in enumerate(_by_base):
        if other is m:
            del _by_base[i]
            del _bases[i]
            break
    os.close(m.fd)


def _prune_deleted() -> None:
    for m in list(_by_base):
        try:
            alive = os.fstat(m.fd).st_nlink > 0
        except OSError:
            alive = False
        if not alive:
            _forget(m)


def is_mapped(fd: int) -> bool:
    """Whether this process has a cached mapping of the file open as ``fd``."""
    st = os.fstat(fd)
    with _lock:
        hit = _by_identity.get((st.st_dev, st.st_ino))
        return hit is not None and hit.size == st.st_size


def find(ptr: int, nbytes: int = 0) -> tuple[FileMapping, int] | None:
    """The cached mapping that holds ``[ptr, ptr + nbytes)``, and the offset of ``ptr`` in its file."""
    with _lock:
        i = bisect.bisect_right(_bases, ptr) - 1
        if i < 0:
            return None
        m = _by_base[i]
        off = ptr - m.base
        if off + nbytes <= m.size and (off < m.size or nbytes == 0):
            return m, off
        return None


def pin(m: FileMapping) -> bool:
    """Register ``m`` with CUDA as page-locked host memory, once; whether it is. Only mappings of
    this cache are pinned (they are unregistered when their file goes away); a failure is logged
    once per mapping and the copies run unpinned, which is slower but correct."""
    if m.pinned:
        return True
    if m.size == 0 or m.fd < 0 or not torch.cuda.is_available():
        return False
    with _lock:
        if m.pinned or _by_identity.get((m.dev, m.ino)) is not m:
            return m.pinned
        if m.pin_failed:
            return False
        err = _cuda_host_register(m.base, m.size)
        if err:
            m.pin_failed = True
            logger.warning(
                "could not pin a %d-byte tier file for CUDA copies (cudaHostRegister error %d); "
                "device copies into and out of it run through pageable memory (slower). Set "
                "TIERCKPT_PIN_MEMORY=0 to stop trying.",
                m.size,
                err,
            )
            return False
        m.pinned = True
        return True


def pin_holding(t: torch.Tensor) -> bool:
    """:func:`pin` the cached mapping that holds CPU tensor ``t``, if any."""
    if t.device.type != "cpu" or not t.numel():
        return False
    hit = find(t.data_ptr(), t.numel() * t.element_size())
    return hit is not None and pin(hit[0])


def _cuda_host_register(ptr: int, size: int) -> int:
    """``cudaHostRegister(ptr, size, cudaHostRegisterPortable)``: 0 or the CUDA error code."""
    return int(torch.cuda.cudart().cudaHostRegister(ptr, size, 1))


def _cuda_host_unregister(ptr: int) -> int:
    return int(torch.cuda.cudart().cudaHostUnregister(ptr))


def clear_cache() -> None:
    """Forget every mapping (tests; a trainer never needs this)."""
    with _lock:
        for m in list(_by_base):
            _forget(m)


# -- pickling -----------------------------------------------------------------------------------


def _rebuild_storage(
    pid: int, fd: int, dev: int, ino: int, offset: int, nbytes: int
) -> torch.UntypedStorage:
    path = f"/proc/{pid}/fd/{fd}"
    mapping = map_file(path, follow=True)
    if (mapping.dev, mapping.ino) != (dev, ino):
        raise CheckpointFormatError(
            f"staged tensors of process {pid} are no longer reachable: {path} is another file"
        )
    return mapping.view(offset, nbytes).untyped_storage()


def _reduce_storage(storage: torch.UntypedStorage) -> Any:
    if storage.device.type == "cpu" and storage.nbytes() > 0:
        try:
            ptr = storage.data_ptr()
        except RuntimeError:  # e.g. the data-less storage of a wrapper subclass
            return _torch_reduce_storage(storage)
        hit = find(ptr, storage.nbytes())
        if hit is not None:
            m, off = hit
            return (_rebuild_storage, (os.getpid(), m.fd, m.dev, m.ino, off, storage.nbytes()))
    return _torch_reduce_storage(storage)


def _rebuild_dtensor(local: torch.Tensor, spec: Any, requires_grad: bool) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=requires_grad)


def _reduce_dtensor(dt: Any) -> Any:
    # DTensor's own pickling goes through the wrapper's storage, which segfaults torch's storage
    # reducer when the local tensor aliases a file mapping; send the local tensor and spec instead.
    local = dt._local_tensor
    if local.device.type == "cpu" and local.numel() and find(local.data_ptr()) is not None:
        return (_rebuild_dtensor, (local, dt._spec, dt.requires_grad))
    return dt.__reduce_ex__(2)


_installed = False
_torch_reduce_storage: Callable[[torch.UntypedStorage], Any]


def install_pickle_reducer() -> None:
    """Route arena storages through :func:`_reduce_storage` in torch's ForkingPickler (idempotent)."""
    global _installed, _torch_reduce_storage
    if _installed:
        return
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing
    from torch.multiprocessing.reductions import reduce_storage

    _torch_reduce_storage = reduce_storage
    from torch.distributed.tensor import DTensor

    ForkingPickler.register(torch.UntypedStorage, _reduce_storage)
    ForkingPickler.register(DTensor, _reduce_dtensor)
    _installed = True
