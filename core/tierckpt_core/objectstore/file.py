"""``file:///abs/path``: the persistent tier on a file system (NFS, FSx for Lustre, local disk)."""

from __future__ import annotations

import builtins
import contextlib
import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tierckpt_core.errors import (
    IntegrityError,
    InvalidNameError,
    NotFoundError,
    PersistentTierError,
)
from tierckpt_core.integrity import Hasher
from tierckpt_core.objectstore.base import TMP_MARKER, ObjectInfo, validate_key, validate_prefix
from tierckpt_core.objectstore.streams import (
    CHUNK_SIZE,
    RateLimiter,
    as_bytes_view,
    copy_stream,
    drain,
    pwriter,
    read_chunks,
)


class FileStore:
    """A directory tree: key ``a/b/c`` is the file ``root/a/b/c``.

    Writes go to a temporary file next to the target, are fsynced, and renamed into place
    (atomic on POSIX file systems, NFS and Lustre included), so a reader never sees a partial
    object and a written object is on stable storage.
    """

    def __init__(self, root: Path | str, *, upload_max_rate: float | None = None) -> None:
        root = Path(root)
        if not root.is_absolute():
            raise InvalidNameError(f"file store root {str(root)!r} must be an absolute path")
        self.root = root
        self.url = f"file://{root}"
        self._limiter = RateLimiter(upload_max_rate) if upload_max_rate else None

    def __repr__(self) -> str:
        return f"FileStore({self.url!r})"

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _fail(self, what: str, key: str, exc: OSError) -> PersistentTierError:
        return PersistentTierError(f"{what} {key!r} in {self.url} failed: {exc}")

    def _write(self, key: str, fill: Callable[[Any], str]) -> str:
        """Write via ``fill(file) -> checksum`` into a temp file, fsync, rename over ``key``."""
        path = self._path(key)
        tmp = path.with_name(f"{path.name}{TMP_MARKER}{uuid.uuid4().hex[:12]}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    digest = fill(f)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            _fsync_dir(path.parent)
        except OSError as e:
            raise self._fail("writing", key, e) from e
        return digest

    def put_file(self, key: str, path: str, length: int | None = None) -> str:
        def fill(f: Any) -> str:
            return copy_stream(path, length, f.write, key, self._limiter)

        return self._write(key, fill)

    def put_bytes(self, key: str, data: bytes | memoryview) -> str:
        def fill(f: Any) -> str:
            h = Hasher()
            view = memoryview(data)
            for off in range(0, len(view), CHUNK_SIZE):
                chunk = view[off : off + CHUNK_SIZE]
                h.update(chunk)
                f.write(chunk)
            return h.hexdigest()

        return self._write(key, fill)

    def get_bytes(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return path.read_bytes()
        except FileNotFoundError as e:
            raise NotFoundError(f"object {key!r} not found in {self.url}") from e
        except OSError as e:
            raise self._fail("reading", key, e) from e

    def get_into(self, key: str, dst: memoryview) -> str:
        out = as_bytes_view(dst)
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size != len(out):
                    raise IntegrityError(
                        f"object {key!r} in {self.url} has {size} bytes, expected {len(out)}"
                    )
                h = Hasher()
                off = 0
                while off < size:
                    n = f.readinto(out[off : off + CHUNK_SIZE])
                    if not n:
                        raise IntegrityError(
                            f"object {key!r} in {self.url} ended after {off} of {size} bytes"
                        )
                    h.update(out[off : off + n])
                    off += n
                return h.hexdigest()
        except FileNotFoundError as e:
            raise NotFoundError(f"object {key!r} not found in {self.url}") from e
        except OSError as e:
            raise self._fail("reading", key, e) from e

    def get_to_file(self, key: str, fd: int, size: int) -> str:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                return drain(read_chunks(f), size, pwriter(fd), f"{key!r} in {self.url}")
        except FileNotFoundError as e:
            raise NotFoundError(f"object {key!r} not found in {self.url}") from e
        except OSError as e:
            raise self._fail("reading", key, e) from e

    def get_range(
        self, key: str, start: int, end: int, put: Callable[[memoryview, int], None]
    ) -> None:
        if end <= start:
            return
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                if size < end:
                    raise IntegrityError(
                        f"object {key!r} in {self.url} has {size} bytes, a read wants up to {end}"
                    )
                buf = memoryview(bytearray(min(CHUNK_SIZE, end - start)))
                off = start
                while off < end:
                    n = os.preadv(f.fileno(), [buf[: min(len(buf), end - off)]], off)
                    if not n:
                        raise IntegrityError(
                            f"object {key!r} in {self.url} ended at byte {off} of {end}"
                        )
                    put(buf[:n], off)
                    off += n
        except FileNotFoundError as e:
            raise NotFoundError(f"object {key!r} not found in {self.url}") from e
        except OSError as e:
            raise self._fail("reading", key, e) from e

    def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        validate_prefix(prefix)
        # Walk only the deepest directory the prefix names, then filter by string prefix
        # (the same semantics as an S3 prefix: "step_1" matches "step_10/...").
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        out: builtins.list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for name in filenames:
                if TMP_MARKER in name:
                    continue
                full = os.path.join(dirpath, name)
                rel = os.path.relpath(full, self.root).replace(os.sep, "/")
                if not rel.startswith(prefix):
                    continue
                try:
                    st = os.stat(full)
                except FileNotFoundError:  # deleted while we walked
                    continue
                out.append(ObjectInfo(rel, st.st_size))
        out.sort(key=lambda o: o.key)
        return out

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        validate_prefix(prefix)
        if prefix and not prefix.endswith("/"):
            raise InvalidNameError(f"a directory listing's prefix ends with '/', not {prefix!r}")
        base = self.root / prefix if prefix else self.root
        try:
            with os.scandir(base) as entries:
                # (an empty directory is named too, where S3 has nothing: a caller finds no key
                # under it)
                return sorted(e.name for e in entries if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise self._fail("listing", prefix, e) from e

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, keys: builtins.list[str]) -> None:
        paths = [self._path(k) for k in keys]  # validate all before deleting any
        emptied: set[Path] = set()
        for key, path in zip(keys, paths, strict=True):
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise self._fail("deleting", key, e) from e
            emptied.add(path.parent)
        # Best effort: drop directories that became empty, up to (not including) the root, once
        # each (deepest first); with them the temporary files of writes a process did not live
        # to finish (a daemon killed mid-upload), once nothing has written them for a while.
        for parent in sorted(emptied, key=lambda p: len(p.parts), reverse=True):
            _drop_stale_tmps(parent)
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def health(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".health{TMP_MARKER}{uuid.uuid4().hex[:12]}"
            with open(probe, "wb") as f:
                f.write(b"ok")
                os.fsync(f.fileno())
            probe.unlink()
        except OSError as e:
            raise PersistentTierError(
                f"persistent tier {self.url} is not usable: cannot create and write files in "
                f"{self.root}: {e}"
            ) from e

    def close(self) -> None:
        pass


STALE_TMP_S = 3600.0
"""A temporary file of a write untouched this long is left from a process that died writing it
(a write in progress touches it at every chunk, even at a low upload rate cap)."""


def _drop_stale_tmps(directory: Path) -> None:
    """Remove ``directory``'s temporary files older than :data:`STALE_TMP_S` (best effort)."""
    cutoff = time.time() - STALE_TMP_S
    try:
        with os.scandir(directory) as entries:
            stale = [
                e.path
                for e in entries
                if TMP_MARKER in e.name
                and e.is_file(follow_symlinks=False)
                and e.stat(follow_symlinks=False).st_mtime < cutoff
            ]
    except OSError:
        return
    for path in stale:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some file systems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)
