"""The persistent tier's interface: a flat key/value object store, and its key rules.

Keys are ``/``-separated paths relative to the store root (the bucket prefix or the directory).
Every upload and download streams in chunks and returns the integrity checksum
(:mod:`tierckpt_core.integrity`) of the bytes that went over the wire, computed on the way.

Errors: a missing object raises :class:`~tierckpt_core.errors.NotFoundError`; a bad key raises
:class:`~tierckpt_core.errors.InvalidNameError`; a downloaded object whose size differs from the
expected one raises :class:`~tierckpt_core.errors.IntegrityError`; everything else (network,
credentials, missing bucket, full disk) raises :class:`~tierckpt_core.errors.PersistentTierError`
naming the store, the key and the cause.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tierckpt_core.errors import InvalidNameError

TMP_MARKER = ".tierckpt-tmp."  # in the names of FileStore's temporary files; never a valid key


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: its key relative to the store root and its size in bytes."""

    key: str
    size: int


class ObjectStore(Protocol):
    """What the daemon and the client need from a persistent tier."""

    url: str

    def put_file(self, key: str, path: str, length: int | None = None) -> str:
        """Upload the first ``length`` bytes (default: all) of a local file; return their checksum."""
        ...

    def put_bytes(self, key: str, data: bytes | memoryview) -> str:
        """Upload ``data``; return its checksum."""
        ...

    def get_bytes(self, key: str) -> bytes:
        """Download a whole object."""
        ...

    def get_into(self, key: str, dst: memoryview) -> str:
        """Download a whole object into ``dst`` (whose length must equal the object's size);
        return the checksum of the bytes read."""
        ...

    def get_to_file(self, key: str, fd: int, size: int) -> str:
        """Download a whole object of ``size`` bytes into the open file ``fd`` at offset 0 with
        ``pwrite``; return the checksum. Into fresh tmpfs pages this runs about twice as fast as
        :meth:`get_into` through a mapping of the file (no page fault per 4 KiB)."""
        ...

    def get_range(
        self, key: str, start: int, end: int, put: Callable[[memoryview, int], None]
    ) -> None:
        """Download bytes ``[start, end)`` of an object, handing them to ``put(chunk, offset)``
        in order (``offset`` counts from the start of the object); IntegrityError if the object
        ends before ``end``. A failed attempt that is retried starts again at ``start``, so
        ``put`` may see an offset twice. Exceptions ``put`` raises end the download as they are."""
        ...

    def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        """All objects whose key starts with ``prefix`` (recursive), sorted by key."""
        ...

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        """The names of the "directories" right under ``prefix`` (ending with ``/``, or empty):
        each first path component after it of a key under it, once, sorted (a file store may
        also name an empty directory); one request per thousand names on S3, where :meth:`list`
        takes one per thousand objects."""
        ...

    def exists(self, key: str) -> bool: ...

    def delete(self, keys: builtins.list[str]) -> None:
        """Delete objects; keys that do not exist are ignored."""
        ...

    def health(self) -> None:
        """Raise :class:`PersistentTierError` saying why if the store is unusable."""
        ...

    def close(self) -> None:
        """Release network clients (the store stays usable: they are rebuilt on demand)."""
        ...


def validate_key(key: str) -> str:
    """Check a store key: ``/``-separated, relative, no empty, ``.`` or ``..`` components."""
    if not isinstance(key, str) or not key:
        raise InvalidNameError(f"invalid object key {key!r}: must be a non-empty string")
    if key.startswith("/"):
        raise InvalidNameError(f"invalid object key {key!r}: must be relative (no leading '/')")
    if "\x00" in key or "\\" in key:
        raise InvalidNameError(f"invalid object key {key!r}: NUL and backslash are not allowed")
    if TMP_MARKER in key:
        raise InvalidNameError(f"invalid object key {key!r}: {TMP_MARKER!r} is reserved")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidNameError(
                f"invalid object key {key!r}: empty, '.' and '..' path components are not allowed"
            )
    return key


def validate_prefix(prefix: str) -> str:
    """A list prefix: like a key, but may be empty and may end with '/'."""
    if prefix:
        validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix
