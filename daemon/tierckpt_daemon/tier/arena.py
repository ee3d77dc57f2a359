"""The shared-memory arena: shard files in a tmpfs directory, a pool of recycled files, the budget.

Copying into tmpfs pages that already exist and are mapped runs at memcpy speed; allocating and
faulting in fresh pages is several times slower (see docs/design.md). So files are never freed on
eviction: they go to ``pool/`` and the next lease of the same size takes one back. New files are
pre-faulted with ``posix_fallocate`` so that the trainer's first copy does not pay for page allocation.

Layout under the tier directory::

    pool/<uuid>.bin                       free, allocated files ready for reuse
    leases/<lease id>.bin                 leased to a trainer, not yet sealed into a step
    ns/<namespace>/<step:012d>-<attempt>/ shard files of one save attempt, MANIFEST.json once committed

:class:`Arena` is not thread-safe on its own: the service holds one lock around every call except
:meth:`Arena.allocate`, which may take seconds and only touches a path nobody else knows yet.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tierckpt_core.errors import CapacityExceededError

logger = logging.getLogger(__name__)

PAGE = 4096


def round_up(size: int, align: int = PAGE) -> int:
    return (size + align - 1) // align * align


Holder = tuple[str, int]
"""Whose file a pooled one was: (namespace, rank)."""


@dataclass
class PoolFile:
    path: Path
    size: int
    since: float
    holder: Holder | None = None  # the rank that last wrote it, if known


class Arena:
    def __init__(self, root: Path, capacity_bytes: int, *, prefault: bool = True) -> None:
        self.root = root
        self.capacity_bytes = capacity_bytes
        self.prefault = prefault
        self.pool_dir = root / "pool"
        self.lease_dir = root / "leases"
        self.ns_dir = root / "ns"
        make_dir(self.root)
        check_root(self.root)
        for d in (self.pool_dir, self.lease_dir, self.ns_dir):
            make_dir(d)
            own_dir(d)
        self._pool: dict[Path, PoolFile] = {}
        self._sizes: dict[Path, int] = {}  # every file the arena accounts for, pool included
        self._reserved = 0

    # -- accounting -------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return sum(self._sizes.values()) + self._reserved

    @property
    def pool_bytes(self) -> int:
        return sum(f.size for f in self._pool.values())

    @property
    def pool_files(self) -> int:
        return len(self._pool)

    def track(self, path: Path, size: int) -> None:
        self._sizes[path] = size

    def size_of(self, path: Path) -> int:
        return self._sizes[path]

    # -- pool -------------------------------------------------------------------------------
    def adopt_into_pool(self, path: Path, holder: Holder | None = None) -> None:
        """Move a file (known or found on disk) into the pool for reuse, remembering ``holder``,
        the rank that wrote it (:meth:`take_from_pool` gives it back to that rank first). Anything
        but a regular file (a link planted in the tier directory, say) is removed, never
        followed."""
        st = _lstat(path)
        if st is None or not stat.S_ISREG(st.st_mode) or not ours(st):
            if st is not None:
                logger.warning("removing %s from the tier directory: %s", path, foreign(st))
                _remove(path)
            self._sizes.pop(path, None)
            self._pool.pop(path, None)
            return
        size = st.st_size
        dst = self.pool_dir / f"{uuid.uuid4().hex}.bin"
        os.rename(path, dst)
        self._sizes.pop(path, None)
        self._sizes[dst] = size
        self._pool[dst] = PoolFile(dst, size, time.monotonic(), holder)

    def add_to_pool(self, path: Path, size: int) -> None:
        self._sizes[path] = size
        self._pool[path] = PoolFile(path, size, time.monotonic())

    def has_pooled(self, size: int) -> bool:
        return any(f.size == size for f in self._pool.values())

    def scan_pool(self) -> None:
        for p in self.pool_dir.iterdir():
            st = _lstat(p)
            if st is not None and p.suffix == ".bin" and stat.S_ISREG(st.st_mode) and ours(st):
                self._sizes[p] = st.st_size
                self._pool[p] = PoolFile(p, st.st_size, time.monotonic())
            else:
                _remove(p)

    def take_from_pool(self, size: int, dst: Path, holder: Holder | None = None) -> bool:
        """Move a pooled file of ``size`` bytes (exact, else the best larger fit) to ``dst``: of
        those, one ``holder`` wrote last if there is one. A rank that gets back its own file
        finds it mapped in its process still (and registered with CUDA): a file another rank
        wrote is mapped afresh, a page fault per 64 KiB or so on the stall's copy, and
        registered again (docs/benchmarks.md, "Beside the peers on the 16-core GPU host")."""
        best: PoolFile | None = None
        exact = [f for f in self._pool.values() if f.size == size]
        if exact:
            best = next((f for f in exact if holder is not None and f.holder == holder), exact[0])
        else:
            for f in self._pool.values():
                # A larger file is shrunk: truncation frees the tail pages, the head stays
                # faulted in.
                fits = size < f.size <= size + max(size // 4, 1 << 20)
                if fits and (best is None or f.size < best.size):
                    best = f
        if best is None:
            return False
        del self._pool[best.path]
        del self._sizes[best.path]
        os.rename(best.path, dst)
        if best.size != size:
            fd = os.open(dst, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            try:
                os.ftruncate(fd, size)
            finally:
                os.close(fd)
        self._sizes[dst] = size
        return True

    def trim_pool(self, need_free: int, *, idle_s: float | None = None) -> int:
        """Delete pool files until ``need_free`` bytes fit (or those idle > ``idle_s``)."""
        freed = 0
        now = time.monotonic()
        for f in sorted(self._pool.values(), key=lambda f: f.since):
            if idle_s is not None and now - f.since < idle_s:
                continue
            if idle_s is None and self.capacity_bytes - self.used_bytes >= need_free:
                break
            self.delete(f.path)
            freed += f.size
        return freed

    # -- files ------------------------------------------------------------------------------
    def reserve(self, size: int) -> None:
        if self.used_bytes + size > self.capacity_bytes:
            raise CapacityExceededError(
                f"the memory tier cannot fit {size} more bytes: capacity {self.capacity_bytes}, "
                f"in use {self.used_bytes}"
            )
        self._reserved += size

    def unreserve(self, size: int) -> None:
        self._reserved -= size

    def allocate(self, path: Path, size: int, *, prefault: bool | None = None) -> None:
        """Create ``path`` with ``size`` bytes, pre-faulted if configured. Call without the lock."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o660)
        try:
            os.fchmod(fd, 0o660)  # not cut by the umask: trainers of the daemon's group write it
            if size and (self.prefault if prefault is None else prefault):
                os.posix_fallocate(fd, 0, size)  # fails fast (ENOSPC) if the tmpfs is too small
                # fallocate only reserves tmpfs pages; they are zeroed on first touch, which would
                # cost the trainer's first copy ~1-3 s/GiB. Touch them here by writing zeros
                # (pwrite releases the GIL, so the daemon keeps answering meanwhile).
                _write_zeros(fd, size)
            else:
                os.ftruncate(fd, size)
        except OSError as e:
            os.close(fd)
            _remove(path)
            raise CapacityExceededError(
                f"could not allocate {size} bytes in {self.root}: {e.strerror}; the tmpfs is "
                "smaller than TIERCKPT_CAPACITY (size /dev/shm or the hostPath accordingly)"
            ) from e
        os.close(fd)

    def move(self, src: Path, dst: Path) -> None:
        os.rename(src, dst)
        self._sizes[dst] = self._sizes.pop(src)

    def shrink(self, path: Path, size: int) -> int:
        """Cut ``path`` to ``size`` bytes if it is larger (its tail pages go back to the tmpfs);
        returns its size now. A sealed file holds only the bytes its save references (a staged
        file of a replicated state is mostly items another rank writes; see docs/design.md)."""
        if size >= self._sizes[path]:
            return self._sizes[path]
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self._sizes[path] = size
        return size

    def delete(self, path: Path) -> None:
        _remove(path)
        self._sizes.pop(path, None)
        self._pool.pop(path, None)


_ZEROS = bytes(16 << 20)


def _write_zeros(fd: int, size: int) -> None:
    view = memoryview(_ZEROS)
    off = 0
    while off < size:
        off += os.pwrite(fd, view[: min(len(view), size - off)], off)


# Only the daemon creates, renames or removes entries in the tier directory: its group (the
# node's trainers) may reach and open the files in it (shard files are 0660), never replace one.
# A group that could write a directory could rename its own socket over daemon.sock, a link over
# a step directory the daemon is about to write through, or its own MANIFEST.json over a step's
# (docs/security.md, "The tier directory").
DIR_MODE = 0o750
_GROUP_OR_OTHER_WRITE = stat.S_IWGRP | stat.S_IWOTH


def make_dir(path: Path) -> None:
    """Create ``path`` (and missing parents) with DIR_MODE whatever the umask; refuse a link.
    An existing directory is left as it is (a parent of the tier directory is not the
    daemon's): :func:`own_dir` makes one of the daemon's its own."""
    st = _lstat(path)
    if st is not None:
        if not stat.S_ISDIR(st.st_mode):
            raise NotADirectoryError(f"{path} exists and is not a directory (a link?)")
        return
    if path.parent != path:
        make_dir(path.parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return
    own_dir(path)


def new_dir(path: Path) -> None:
    """Create directory ``path``, which must not exist, with DIR_MODE whatever the umask."""
    os.mkdir(path, DIR_MODE)
    own_dir(path)


def own_dir(path: Path) -> None:
    """Make the daemon's directory ``path`` DIR_MODE (an earlier daemon made them 0770, a umask
    may have taken bits off), through a descriptor opened without following a link. Raises
    NotADirectoryError for a link or anything but a directory, PermissionError for a directory
    another user owns (planted: never adopted)."""
    with _own_dir_fd(path) as (fd, st):
        if stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)


@contextlib.contextmanager
def _own_dir_fd(path: Path, hint: str = "") -> Iterator[tuple[int, os.stat_result]]:
    """A descriptor of the daemon's own directory ``path`` (opened without following a link)
    and its status; NotADirectoryError for a link or anything but a directory, PermissionError
    (with ``hint``) for one another user owns."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotADirectoryError(f"{path} is not a directory (a link?)") from None
        raise
    try:
        st = os.fstat(fd)
        if not ours(st):
            raise PermissionError(f"{path} {foreign(st)}{hint}")
        yield fd, st
    finally:
        os.close(fd)


def check_root(root: Path) -> None:
    """The tier directory must be the daemon's and writable by no one else: whoever could write
    it could replace the daemon's socket (every trainer of the node would then talk to its
    process) or its lock. Group or other write permission on a directory the daemon owns is
    taken off, with a WARNING (an earlier daemon made it 0770); one owned by another user, or a
    shared one (sticky and writable by others: /dev/shm itself, as root), fails the start
    (PermissionError)."""
    hint = (
        ": another user could replace the daemon's socket there; give it to uid "
        f"{os.geteuid()} (chown) or use a directory of the daemon's own"
    )
    with _own_dir_fd(root, hint) as (fd, st):
        mode = stat.S_IMODE(st.st_mode)
        if mode & stat.S_ISVTX and mode & stat.S_IWOTH:
            # A shared directory (/dev/shm, /tmp): never the daemon's to change.
            raise PermissionError(
                f"{root} is a shared directory (mode {mode:o}: others create entries there) "
                "where another user could replace the daemon's socket or files; use a "
                f"directory of the daemon's own inside it (e.g. {root / 'tierckpt'})"
            )
        if mode & _GROUP_OR_OTHER_WRITE:
            os.fchmod(fd, mode & ~_GROUP_OR_OTHER_WRITE)
            logger.warning(
                "%s was mode %o: made it %o (the group and others may enter it, not create, "
                "rename or remove entries: a trainer could otherwise replace the daemon's socket)",
                root,
                mode,
                mode & ~_GROUP_OR_OTHER_WRITE,
            )


def ours(st: os.stat_result) -> bool:
    """Whether a file with status ``st`` is the daemon's (its effective uid's)."""
    return st.st_uid == os.geteuid()


def foreign(st: os.stat_result) -> str:
    """Why a file with status ``st`` that is not the daemon's own is refused, in words."""
    if ours(st) or not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return "not a regular file"
    return f"belongs to uid {st.st_uid}, not to the daemon (uid {os.geteuid()})"


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def _remove(path: Path) -> None:
    """Remove ``path``: a directory with its contents, anything else (a link included) itself;
    never what a link points to."""
    st = _lstat(path)
    if st is None:
        return
    try:
        if stat.S_ISDIR(st.st_mode):
            for child in path.iterdir():
                _remove(child)
            path.rmdir()
        else:
            path.unlink()
    except FileNotFoundError:
        pass
