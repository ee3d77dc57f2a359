"""``s3://bucket/prefix``: data through s3torchconnector's CRT client, control calls through boto3.

The CRT client (``s3torchconnectorclient``, the native half of s3torchconnector, which unlike
``s3torchconnector`` itself does not import torch) and boto3 are imported lazily, so importing this
module is cheap and a ``file://`` store needs neither.
"""

from __future__ import annotations

import builtins
import logging
import os
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tierckpt_core.errors import (
    InvalidNameError,
    NotFoundError,
    PersistentTierError,
    PersistentTierUnavailableError,
)
from tierckpt_core.integrity import Hasher
from tierckpt_core.objectstore.base import ObjectInfo, validate_key, validate_prefix
from tierckpt_core.objectstore.settings import StoreSettings
from tierckpt_core.objectstore.streams import (
    CHUNK_SIZE,
    RateLimiter,
    as_bytes_view,
    copy_stream,
    drain,
    pwriter,
)

if TYPE_CHECKING:
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

logger = logging.getLogger(__name__)

_DELETE_BATCH = 1000  # the S3 DeleteObjects limit

_T = TypeVar("_T")


class _RetryableS3Error(PersistentTierUnavailableError):
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
        settings: StoreSettings | None = None,
    ) -> None:
        if not bucket or "/" in bucket:
            raise InvalidNameError(f"invalid S3 bucket name {bucket!r}")
        prefix = prefix.strip("/")
        if prefix:
            validate_key(prefix)
        self.bucket = bucket
        self.prefix = prefix
        self.settings = settings = settings or StoreSettings()
        self.endpoint = settings.endpoint
        self.region = settings.region
        self.force_path_style = settings.force_path_style
        self.timeout_s = settings.timeout_s
        self.max_attempts = max(1, settings.max_attempts)
        self._limiter = RateLimiter(settings.upload_max_rate) if settings.upload_max_rate else None
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
            digest = copy_stream(path, length, stream.write, key, self._limiter)
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
        out = as_bytes_view(dst)

        def put(chunk: memoryview, off: int) -> None:
            out[off : off + len(chunk)] = chunk

        return self._download(key, len(out), put)

    def get_to_file(self, key: str, fd: int, size: int) -> str:
        return self._download(key, size, pwriter(fd))

    def _download(self, key: str, size: int, put: Callable[[memoryview, int], None]) -> str:
        full = self._full(key)

        def download() -> str:
            chunks = self._crt_client().get_object(self.bucket, full)
            return drain(chunks, size, put, self._where(key))

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
        validate_prefix(prefix)
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
