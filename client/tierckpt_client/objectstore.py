"""The persistent tier as a flat key/value object store: S3 (``s3://bucket/prefix``) or a file
system (``file:///abs/path``: NFS, FSx for Lustre, local disk).

Both the daemon (uploader, restore) and the client (degraded mode, restore without a daemon) use
this module, so it imports no torch: S3 data goes through s3torchconnector's CRT client
(``s3torchconnectorclient``, the native half of s3torchconnector, which unlike ``s3torchconnector``
itself does not import torch), control calls (list, head, delete, head-bucket) through boto3. Both
are imported lazily, so importing this module is cheap and a ``file://`` store needs neither.

Keys are ``/``-separated paths relative to the store root (the bucket prefix or the directory).
Every upload and download streams in chunks and returns the integrity checksum
(:mod:`tierckpt_client.integrity`) of the bytes that went over the wire, computed on the way.

Errors: a missing object raises :class:`~tierckpt_client.errors.NotFoundError`; a bad key raises
:class:`~tierckpt_client.errors.InvalidNameError`; a downloaded object whose size differs from the
expected one raises :class:`~tierckpt_client.errors.IntegrityError`; everything else (network,
credentials, missing bucket, full disk) raises :class:`~tierckpt_client.errors.PersistentTierError`
naming the store, the key and the cause.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar
from urllib.parse import urlparse

from .errors import (
    IntegrityError,
    InvalidNameError,
    NotFoundError,
    PersistentTierError,
)
from .integrity import Hasher

if TYPE_CHECKING:
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

logger = logging.getLogger(__name__)

CHUNK_SIZE = 8 * 1024 * 1024
"""Bytes per read/write while streaming (also the CRT multipart part size)."""

_DELETE_BATCH = 1000  # the S3 DeleteObjects limit
_TMP_MARKER = ".tierckpt-tmp."  # in the names of FileStore's temporary files; never a valid key

_T = TypeVar("_T")


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

    def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        """All objects whose key starts with ``prefix`` (recursive), sorted by key."""
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
    if _TMP_MARKER in key:
        raise InvalidNameError(f"invalid object key {key!r}: {_TMP_MARKER!r} is reserved")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidNameError(
                f"invalid object key {key!r}: empty, '.' and '..' path components are not allowed"
            )
    return key


def _validate_prefix(prefix: str) -> str:
    """A list prefix: like a key, but may be empty and may end with '/'."""
    if prefix:
        validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
    return prefix


def _drain(
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


def _read_chunks(f: Any) -> Iterator[memoryview]:
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


def _as_bytes_view(dst: memoryview) -> memoryview:
    if dst.readonly:
        raise ValueError("get_into needs a writable buffer")
    return dst if dst.format == "B" and dst.ndim == 1 else dst.cast("B")


# --------------------------------------------------------------------------------------------
# File system
# --------------------------------------------------------------------------------------------


class FileStore:
    """A directory tree: key ``a/b/c`` is the file ``root/a/b/c``.

    Writes go to a temporary file next to the target, are fsynced, and renamed into place
    (atomic on POSIX file systems, NFS and Lustre included), so a reader never sees a partial
    object and a written object is on stable storage.
    """

    def __init__(self, root: Path | str) -> None:
        root = Path(root)
        if not root.is_absolute():
            raise InvalidNameError(f"file store root {str(root)!r} must be an absolute path")
        self.root = root
        self.url = f"file://{root}"

    def __repr__(self) -> str:
        return f"FileStore({self.url!r})"

    def _path(self, key: str) -> Path:
        return self.root / validate_key(key)

    def _fail(self, what: str, key: str, exc: OSError) -> PersistentTierError:
        return PersistentTierError(f"{what} {key!r} in {self.url} failed: {exc}")

    def _write(self, key: str, fill: Callable[[Any], str]) -> str:
        """Write via ``fill(file) -> checksum`` into a temp file, fsync, rename over ``key``."""
        path = self._path(key)
        tmp = path.with_name(f"{path.name}{_TMP_MARKER}{uuid.uuid4().hex[:12]}")
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
            return _copy_stream(path, length, f.write, key)

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
        out = _as_bytes_view(dst)
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
                return _drain(_read_chunks(f), size, pwriter(fd), f"{key!r} in {self.url}")
        except FileNotFoundError as e:
            raise NotFoundError(f"object {key!r} not found in {self.url}") from e
        except OSError as e:
            raise self._fail("reading", key, e) from e

    def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        _validate_prefix(prefix)
        # Walk only the deepest directory the prefix names, then filter by string prefix
        # (the same semantics as an S3 prefix: "step_1" matches "step_10/...").
        base = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        out: builtins.list[ObjectInfo] = []
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames.sort()
            for name in filenames:
                if _TMP_MARKER in name:
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

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def delete(self, keys: builtins.list[str]) -> None:
        paths = [self._path(k) for k in keys]  # validate all before deleting any
        for key, path in zip(keys, paths, strict=True):
            try:
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                raise self._fail("deleting", key, e) from e
            # Best effort: drop directories that became empty, up to (not including) the root.
            parent = path.parent
            while parent != self.root and self.root in parent.parents:
                try:
                    parent.rmdir()
                except OSError:
                    break
                parent = parent.parent

    def health(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".health{_TMP_MARKER}{uuid.uuid4().hex[:12]}"
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


class RateLimiter:
    """Average-rate cap shared by every upload of the process (a token bucket of one chunk)."""

    def __init__(self, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"an upload rate must be > 0 bytes/s, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._next = time.monotonic()

    def acquire(self, nbytes: int) -> None:
        with self._lock:
            now = time.monotonic()
            start = max(now, self._next)
            self._next = start + nbytes / self.bytes_per_s
        if start > now:
            time.sleep(start - now)


_upload_limiter: RateLimiter | None = None


def set_upload_rate_limit(bytes_per_s: float | None) -> None:
    """Cap this process's uploads (``TIERCKPT_UPLOAD_MAX_RATE`` in the daemon); None lifts it."""
    global _upload_limiter
    _upload_limiter = RateLimiter(bytes_per_s) if bytes_per_s else None


def _copy_stream(path: str, length: int | None, write: Callable[[bytes], Any], key: str) -> str:
    """Stream the first ``length`` bytes of ``path`` to ``write`` in chunks; return the checksum."""
    h = Hasher()
    with open(path, "rb", buffering=0) as src:
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
            limiter = _upload_limiter
            if limiter is not None:
                limiter.acquire(len(chunk))
            write(chunk)
            remaining -= len(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# S3
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreSettings:
    """How to reach S3; the bucket and prefix come from the store URL.

    Credentials come from the standard AWS chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
    ``AWS_PROFILE``, instance/IRSA roles), which both the CRT client and boto3 read.
    """

    endpoint: str | None = None
    region: str = "us-east-1"
    force_path_style: bool = False
    timeout_s: float = 60.0
    max_attempts: int = 5

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StoreSettings:
        """Read ``TIERCKPT_S3_ENDPOINT``, ``TIERCKPT_S3_REGION`` (else ``AWS_REGION``,
        ``AWS_DEFAULT_REGION``), ``TIERCKPT_S3_FORCE_PATH_STYLE``, ``TIERCKPT_S3_TIMEOUT`` and
        ``TIERCKPT_S3_MAX_ATTEMPTS``."""
        env = os.environ if env is None else env
        region = (
            env.get("TIERCKPT_S3_REGION")
            or env.get("AWS_REGION")
            or env.get("AWS_DEFAULT_REGION")
            or cls.region
        )
        path_style = env.get("TIERCKPT_S3_FORCE_PATH_STYLE", "").strip().lower()
        try:
            timeout_s = float(env.get("TIERCKPT_S3_TIMEOUT") or cls.timeout_s)
            max_attempts = int(env.get("TIERCKPT_S3_MAX_ATTEMPTS") or cls.max_attempts)
        except ValueError as e:
            raise PersistentTierError(
                f"invalid TIERCKPT_S3_TIMEOUT / TIERCKPT_S3_MAX_ATTEMPTS: {e}"
            ) from e
        if timeout_s <= 0 or max_attempts < 1:
            raise PersistentTierError(
                "TIERCKPT_S3_TIMEOUT must be > 0 and TIERCKPT_S3_MAX_ATTEMPTS >= 1, got "
                f"{timeout_s} and {max_attempts}"
            )
        return cls(
            endpoint=env.get("TIERCKPT_S3_ENDPOINT") or None,
            region=region,
            force_path_style=path_style in ("1", "true", "yes", "on"),
            timeout_s=timeout_s,
            max_attempts=max_attempts,
        )


class _RetryableS3Error(PersistentTierError):
    """A transient data-path failure (network, throttling, 5xx): retried by tenacity."""


# Substrings of the CRT client's S3Exception messages (it has one exception type; the message is
# the only thing that tells errors apart). Checked in lowercase.
_CRT_NOT_FOUND = ("the key does not exist", "the object was not found", "nosuchkey")
_CRT_NO_BUCKET = ("the bucket does not exist", "nosuchbucket")
_RESPONSE_STATUS = re.compile(r"response_status: (\d{3})")
_CRT_AUTH = (
    "forbidden",
    "access denied",
    "accessdenied",
    "invalidaccesskeyid",
    "signature",
    "no credentials",
    "credentials provider",
    "expiredtoken",
)


class S3Store:
    """``s3://bucket/prefix``: data through the CRT client, control calls through boto3.

    Network clients are created lazily (and again after a fork or unpickling), so a store can be
    pickled into a spawn child.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint: str | None = None,
        region: str = "us-east-1",
        force_path_style: bool = False,
        timeout_s: float = 60.0,
        max_attempts: int = 5,
    ) -> None:
        if not bucket or "/" in bucket:
            raise InvalidNameError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint
        self.region = region
        self.force_path_style = force_path_style
        self.timeout_s = timeout_s
        self.max_attempts = max(1, max_attempts)
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._lock = threading.Lock()
        self._crt: MountpointS3Client | None = None
        self._boto: Any = None
        self._pid = os.getpid()

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_lock=None, _crt=None, _boto=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pid = os.getpid()

    # -- clients --------------------------------------------------------------------------

    def _check_pid(self) -> None:
        if self._pid != os.getpid():  # forked: the parent's clients are not ours to use
            self._crt = None
            self._boto = None
            self._lock = threading.Lock()
            self._pid = os.getpid()

    def _crt_client(self) -> MountpointS3Client:
        self._check_pid()
        with self._lock:
            if self._crt is None:
                from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

                self._crt = MountpointS3Client(
                    region=self.region,
                    user_agent_prefix="tierckpt",
                    part_size=CHUNK_SIZE,
                    endpoint=self.endpoint,
                    force_path_style=self.force_path_style,
                    max_attempts=self.max_attempts,
                )
            return self._crt

    def _boto_client(self) -> Any:
        self._check_pid()
        with self._lock:
            if self._boto is None:
                import boto3
                from botocore.config import Config

                config = Config(
                    region_name=self.region,
                    s3={"addressing_style": "path" if self.force_path_style else "auto"},
                    connect_timeout=min(self.timeout_s, 10.0),
                    read_timeout=self.timeout_s,
                    retries={"max_attempts": self.max_attempts, "mode": "standard"},
                    # We checksum every byte ourselves (xxh3); S3-compatible servers vary in
                    # their support of the newer flexible checksums.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                )
                self._boto = boto3.session.Session().client(
                    "s3", endpoint_url=self.endpoint, config=config
                )
            return self._boto

    def close(self) -> None:
        with self._lock:
            boto, self._boto, self._crt = self._boto, None, None
        if boto is not None:
            boto.close()

    def __enter__(self) -> S3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers --------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full(key)}"

    def _map_crt(self, what: str, key: str, exc: Exception) -> PersistentTierError | NotFoundError:
        msg = str(exc)
        low = msg.lower()
        where = self._where(key)
        if any(s in low for s in _CRT_NOT_FOUND):
            return NotFoundError(f"object {key!r} not found ({where})")
        if any(s in low for s in _CRT_NO_BUCKET):
            return PersistentTierError(
                f"{what} {where} failed: bucket {self.bucket!r} does not exist ({msg})"
            )
        if any(s in low for s in _CRT_AUTH):
            return PersistentTierError(
                f"{what} {where} failed: access denied, check the S3 credentials "
                f"(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or role): {msg}"
            )
        status = _RESPONSE_STATUS.search(msg)
        if status and 400 <= int(status.group(1)) < 500 and int(status.group(1)) not in (408, 429):
            # a client error (bad request, range, precondition): repeating it will not help
            return PersistentTierError(f"{what} {where} failed: {msg}")
        return _RetryableS3Error(f"{what} {where} failed: {msg}")

    def _data_call(self, what: str, key: str, fn: Callable[[], _T]) -> _T:
        """Run one data-path operation, mapping CRT errors and retrying transient ones."""
        import tenacity
        from s3torchconnectorclient import S3Exception

        def attempt() -> _T:
            try:
                return fn()
            except S3Exception as e:
                raise self._map_crt(what, key, e) from e

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(_RetryableS3Error),
            stop=tenacity.stop_after_attempt(self.max_attempts),
            wait=tenacity.wait_exponential(multiplier=0.2, max=10.0),
            before_sleep=tenacity.before_sleep_log(logger, logging.WARNING),
            reraise=True,
        )
        return retrying(attempt)

    def _map_boto(self, what: str, key: str | None, exc: Exception) -> Exception:
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            NoCredentialsError,
        )

        where = self._where(key) if key is not None else self.url
        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket" or (key is None and status == 404):
                return PersistentTierError(
                    f"{what} {where} failed: bucket {self.bucket!r} does not exist"
                    + (f" at {self.endpoint}" if self.endpoint else "")
                )
            if code in ("NoSuchKey", "404") and key is not None:
                return NotFoundError(f"object {key!r} not found ({where})")
            if status == 403 or code in (
                "AccessDenied",
                "403",
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "ExpiredToken",
            ):
                return PersistentTierError(
                    f"{what} {where} failed: access denied ({code}), check the S3 credentials "
                    "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or role) and the "
                    "bucket policy"
                )
            return PersistentTierError(f"{what} {where} failed: {code or status}: {exc}")
        if isinstance(exc, NoCredentialsError):
            return PersistentTierError(
                f"{what} {where} failed: no S3 credentials found (set AWS_ACCESS_KEY_ID/"
                "AWS_SECRET_ACCESS_KEY, AWS_PROFILE or attach a role)"
            )
        if isinstance(exc, BotoCoreError):
            return PersistentTierError(f"{what} {where} failed: {exc}")
        return exc

    def _control(self, what: str, key: str | None, fn: Callable[[Any], _T]) -> _T:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self._boto_client()
        try:
            return fn(client)
        except (ClientError, BotoCoreError) as e:
            raise self._map_boto(what, key, e) from e

    # -- data path (CRT) ------------------------------------------------------------------

    def put_file(self, key: str, path: str, length: int | None = None) -> str:
        full = self._full(key)

        def upload() -> str:
            stream = self._crt_client().put_object(self.bucket, full)
            digest = _copy_stream(path, length, stream.write, key)
            stream.close()
            return digest

        try:
            return self._data_call("uploading", key, upload)
        except OSError as e:
            raise PersistentTierError(f"uploading {self._where(key)}: reading {path}: {e}") from e

    def put_bytes(self, key: str, data: bytes | memoryview) -> str:
        full = self._full(key)
        data = bytes(data)  # the CRT stream accepts only bytes (not memoryview/bytearray)

        def upload() -> str:
            h = Hasher()
            stream = self._crt_client().put_object(self.bucket, full)
            if len(data) <= CHUNK_SIZE:
                h.update(data)
                stream.write(data)
            else:
                view = memoryview(data)
                for off in range(0, len(data), CHUNK_SIZE):
                    chunk = view[off : off + CHUNK_SIZE]
                    h.update(chunk)
                    stream.write(chunk.tobytes())
            stream.close()
            return h.hexdigest()

        return self._data_call("uploading", key, upload)

    def get_bytes(self, key: str) -> bytes:
        full = self._full(key)

        def download() -> bytes:
            return b"".join(self._crt_client().get_object(self.bucket, full))

        try:
            return self._data_call("downloading", key, download)
        except PersistentTierError as e:
            if self._is_empty_object(key, e):
                return b""
            raise

    def get_into(self, key: str, dst: memoryview) -> str:
        out = _as_bytes_view(dst)

        def put(chunk: memoryview, off: int) -> None:
            out[off : off + len(chunk)] = chunk

        return self._download(key, len(out), put)

    def get_to_file(self, key: str, fd: int, size: int) -> str:
        return self._download(key, size, pwriter(fd))

    def _download(self, key: str, size: int, put: Callable[[memoryview, int], None]) -> str:
        full = self._full(key)

        def download() -> str:
            chunks = self._crt_client().get_object(self.bucket, full)
            return _drain(chunks, size, put, self._where(key))

        try:
            return self._data_call("downloading", key, download)
        except PersistentTierError as e:
            if size == 0 and self._is_empty_object(key, e):
                return Hasher().hexdigest()
            raise

    def _is_empty_object(self, key: str, exc: PersistentTierError) -> bool:
        """The CRT reads objects with ranged GETs, which some servers (SeaweedFS) answer with
        416 InvalidRange for an empty object: confirm with a HEAD that the object is empty."""
        if "InvalidRange" not in str(exc) and "response_status: 416" not in str(exc):
            return False
        full = self._full(key)
        head = self._control("checking", key, lambda c: c.head_object(Bucket=self.bucket, Key=full))
        return int(head["ContentLength"]) == 0

    # -- control path (boto3) -------------------------------------------------------------

    def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        _validate_prefix(prefix)
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix

        def run(client: Any) -> builtins.list[ObjectInfo]:
            out: builtins.list[ObjectInfo] = []
            paginator = client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=full_prefix):
                for obj in page.get("Contents", []):
                    out.append(ObjectInfo(self._rel(obj["Key"]), int(obj["Size"])))
            return out

        out = self._control("listing", None, run)
        out.sort(key=lambda o: o.key)
        return out

    def exists(self, key: str) -> bool:
        full = self._full(key)

        def run(client: Any) -> bool:
            client.head_object(Bucket=self.bucket, Key=full)
            return True

        try:
            return self._control("checking", key, run)
        except NotFoundError:
            return False

    def delete(self, keys: builtins.list[str]) -> None:
        fulls = [self._full(k) for k in keys]
        for start in range(0, len(fulls), _DELETE_BATCH):
            batch = fulls[start : start + _DELETE_BATCH]

            def run(client: Any, batch: builtins.list[str] = batch) -> Any:
                return client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )

            resp = self._control("deleting from", None, run)
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                raise PersistentTierError(
                    f"deleting from {self.url} failed for {len(errors)} object(s), e.g. "
                    f"{first.get('Key')!r}: {first.get('Code')}: {first.get('Message')}"
                )

    def health(self) -> None:
        self._control("checking", None, lambda c: c.head_bucket(Bucket=self.bucket))


# --------------------------------------------------------------------------------------------


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
        return S3Store(
            parsed.netloc,
            parsed.path.strip("/"),
            endpoint=s.endpoint,
            region=s.region,
            force_path_style=s.force_path_style,
            timeout_s=s.timeout_s,
            max_attempts=s.max_attempts,
        )
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
            raise InvalidNameError(
                f"invalid store URL {url!r}: the path must be absolute; {accepted}"
            )
        if parsed.query or parsed.fragment:
            raise InvalidNameError(f"invalid store URL {url!r}: no query or fragment; {accepted}")
        return FileStore(Path(parsed.path))
    raise InvalidNameError(f"unsupported store URL {url!r}; {accepted}")
