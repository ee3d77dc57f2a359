"""The persistent tier as a flat key/value object store: S3 (``s3://bucket/prefix``) or a file
system (``file:///abs/path``: NFS, FSx for Lustre, local disk).

Both the daemon (uploader, restore) and the client (degraded mode, restore without a daemon) use
this package, so it imports no torch. ``base`` holds the interface and key rules, ``streams`` the
chunked copy loops, ``file`` and ``s3`` the two stores, ``settings`` how to reach them, and
:func:`open_store` below picks one from a URL.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from tierckpt_core.errors import InvalidNameError
from tierckpt_core.objectstore.base import ObjectInfo, ObjectStore, validate_key
from tierckpt_core.objectstore.file import FileStore
from tierckpt_core.objectstore.s3 import S3Store
from tierckpt_core.objectstore.settings import StoreSettings
from tierckpt_core.objectstore.streams import CHUNK_SIZE, RateLimiter, pwriter

__all__ = [
    "CHUNK_SIZE",
    "FileStore",
    "ObjectInfo",
    "ObjectStore",
    "RateLimiter",
    "S3Store",
    "StoreSettings",
    "open_store",
    "pwriter",
    "validate_key",
]


def open_store(url: str, settings: StoreSettings | None = None) -> ObjectStore:
    """The store for ``s3://bucket[/prefix]`` or ``file:///abs/path``."""
    accepted = "accepted forms: 's3://bucket[/prefix]' or 'file:///absolute/path'"
    parsed = urlparse(url)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise InvalidNameError(f"invalid store URL {url!r}: no bucket; {accepted}")
        if parsed.query or parsed.fragment:
            raise InvalidNameError(f"invalid store URL {url!r}: no query or fragment; {accepted}")
        s = settings or StoreSettings.from_env()
        return S3Store(parsed.netloc, parsed.path.strip("/"), s)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise InvalidNameError(
                f"invalid store URL {url!r}: the path must be absolute; {accepted}"
            )
        if parsed.query or parsed.fragment:
            raise InvalidNameError(f"invalid store URL {url!r}: no query or fragment; {accepted}")
        rate = settings.upload_max_rate if settings is not None else None
        return FileStore(Path(parsed.path), upload_max_rate=rate)
    raise InvalidNameError(f"unsupported store URL {url!r}; {accepted}")
