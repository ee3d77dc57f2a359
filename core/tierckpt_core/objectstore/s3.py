"""``s3://bucket/prefix``: data through s3torchconnector's CRT client, control calls through boto3.

The CRT client (``s3torchconnectorclient``, the native half of s3torchconnector, which unlike
``s3torchconnector`` itself does not import torch) and boto3 are imported lazily, so importing this
module is cheap and a ``file://`` store needs neither. How each call runs (its deadline, retries,
errors) is :mod:`~tierckpt_core.objectstore.s3_calls`; this module says what the calls are.
"""

from __future__ import annotations

import builtins
import time
from collections.abc import Callable, Iterator
from typing import Any

from tierckpt_core.errors import (
    IntegrityError,
    InvalidNameError,
    NotFoundError,
    PersistentTierError,
)
from tierckpt_core.integrity import Hasher
from tierckpt_core.objectstore.base import ObjectInfo, validate_prefix
from tierckpt_core.objectstore.s3_calls import S3Calls
from tierckpt_core.objectstore.streams import (
    CHUNK_SIZE,
    as_bytes_view,
    copy_stream,
    drain,
    pwriter,
)
from tierckpt_core.objectstore.watchdog import Deadline

_DELETE_BATCH = 1000  # the S3 DeleteObjects limit


class S3Store(S3Calls):
    """``s3://bucket/prefix``: data through the CRT client, control calls through boto3.

    Network clients are created lazily (and again after a fork or unpickling), so a store can be
    pickled into a spawn child.
    """

    def __repr__(self) -> str:
        return f"S3Store({self.url!r}, endpoint={self.endpoint!r})"

    def __enter__(self) -> S3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- data path (CRT) ------------------------------------------------------------------

    def put_file(self, key: str, path: str, length: int | None = None) -> str:
        full = self._full(key)

        def upload(d: Deadline) -> str:
            stream = self._crt_client().put_object(self.bucket, full)
            sent = 0

            def write(chunk: bytes) -> None:
                nonlocal sent
                if self._limiter is not None:
                    wait = self._limiter.reserve(len(chunk))
                    d.extend("waiting for the upload rate cap", wait + self.timeout_s)
                    time.sleep(max(wait, 0.0))
                d.extend(f"writing bytes {sent}-{sent + len(chunk)}", self._allow(len(chunk)))
                stream.write(chunk)
                sent += len(chunk)

            digest = copy_stream(path, length, write, key)
            d.extend(f"completing the upload of {sent} bytes", self._allow(sent))
            stream.close()
            return digest

        try:
            return self._data_call("uploading", key, upload)
        except OSError as e:
            raise PersistentTierError(f"uploading {self._where(key)}: reading {path}: {e}") from e

    def put_bytes(self, key: str, data: bytes | memoryview) -> str:
        full = self._full(key)
        data = bytes(data)  # the CRT stream accepts only bytes (not memoryview/bytearray)

        def upload(d: Deadline) -> str:
            h = Hasher()
            stream = self._crt_client().put_object(self.bucket, full)
            view = memoryview(data)
            for off in range(0, len(data), CHUNK_SIZE):
                chunk = view[off : off + CHUNK_SIZE]
                h.update(chunk)
                d.extend(f"writing bytes {off}-{off + len(chunk)}", self._allow(len(chunk)))
                stream.write(data if len(chunk) == len(data) else chunk.tobytes())
            d.extend(f"completing the upload of {len(data)} bytes", self._allow(len(data)))
            stream.close()
            return h.hexdigest()

        return self._data_call("uploading", key, upload)

    def get_bytes(self, key: str) -> bytes:
        # The size comes first from a HEAD: a server (or a middlebox) that ends a small response
        # early with a matching Content-Length gets a short body past the CRT client.
        # The HEAD goes through the CRT client too: a trainer reading a manifest then needs no
        # boto3 client, whose creation (loading botocore's service models) cost 0.6 s per
        # restore here (py-spy, issue 15).
        full = self._full(key)
        size = self._data_call(
            "checking", key, lambda d: int(self._crt_client().head_object(self.bucket, full).size)
        )
        buf = bytearray(size)
        if buf:
            self.get_into(key, memoryview(buf))
        return bytes(buf)

    def get_into(self, key: str, dst: memoryview) -> str:
        out = as_bytes_view(dst)

        def put(chunk: memoryview, off: int) -> None:
            out[off : off + len(chunk)] = chunk

        return self._download(key, len(out), put)

    def get_to_file(self, key: str, fd: int, size: int) -> str:
        return self._download(key, size, pwriter(fd))

    def _download(self, key: str, size: int, put: Callable[[memoryview, int], None]) -> str:
        full = self._full(key)

        def download(d: Deadline) -> str:
            def guarded(view: memoryview, off: int) -> None:
                # Never write into the caller's buffer or file once the caller gave up on us.
                with d.exclusive():
                    put(view, off)

            return drain(self._chunks(d, full), size, guarded, self._where(key))

        try:
            return self._data_call("downloading", key, download)
        except PersistentTierError as e:
            if size == 0 and self._is_empty_object(key, e):
                return Hasher().hexdigest()
            raise

    def get_range(
        self, key: str, start: int, end: int, put: Callable[[memoryview, int], None]
    ) -> None:
        if end <= start:
            return
        full = self._full(key)
        where = self._where(key)

        def download(d: Deadline) -> None:
            off = start
            for chunk in self._chunks(d, full, start, end):
                view = memoryview(chunk)
                if off + len(view) > end:
                    raise IntegrityError(
                        f"a ranged read of {where} got more than bytes {start}-{end}"
                    )
                # Never write into the caller's buffers once the caller gave up on us.
                with d.exclusive():
                    put(view, off)
                off += len(view)
            if off != end:
                raise IntegrityError(f"{where} ended at byte {off}, a read wants up to {end}")

        self._data_call("downloading", key, download)

    def _chunks(
        self, d: Deadline, full: str, start: int | None = None, end: int | None = None
    ) -> Iterator[Any]:
        """The chunks of a GET (of bytes ``[start, end)``: a ranged one), each under its own
        deadline."""
        client = self._crt_client()
        stream = (
            client.get_object(self.bucket, full)
            if start is None
            else client.get_object(self.bucket, full, start, end)
        )
        chunks = iter(stream)
        got = 0
        while True:
            d.extend(f"reading from byte {got}", self._allow(CHUNK_SIZE))
            chunk = next(chunks, None)
            if chunk is None:
                return
            got += len(chunk)
            yield chunk

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

    def list_dirs(self, prefix: str) -> builtins.list[str]:
        validate_prefix(prefix)
        if prefix and not prefix.endswith("/"):
            raise InvalidNameError(f"a directory listing's prefix ends with '/', not {prefix!r}")
        full_prefix = f"{self.prefix}/{prefix}" if self.prefix else prefix

        def run(client: Any) -> builtins.list[str]:
            out: builtins.list[str] = []
            paginator = client.get_paginator("list_objects_v2")
            pages = paginator.paginate(Bucket=self.bucket, Prefix=full_prefix, Delimiter="/")
            for page in pages:
                for common in page.get("CommonPrefixes", []):
                    out.append(common["Prefix"][len(full_prefix) :].rstrip("/"))
            return out

        return sorted(self._control("listing", None, run))

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
