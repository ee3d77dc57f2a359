"""How one call reaches an S3 bucket, for :class:`~tierckpt_core.objectstore.s3.S3Store`: the
clients (made lazily, and again after a fork or unpickling, so a store can be pickled into a spawn
child), each data call under a deadline and retried while its failure is transient, each control
call's SDK errors translated (:mod:`~tierckpt_core.objectstore.s3_clients`).

Every call is bounded by ``TIERCKPT_S3_TIMEOUT``: boto3 has connect and read timeouts; the CRT client
has none, so its data calls run under a :mod:`~tierckpt_core.objectstore.watchdog` deadline per
step (starting, each chunk written or read, completing an upload, which may also take the upload's
size at ``TIERCKPT_S3_MIN_RATE``). A step that overruns is abandoned and retried on a fresh client;
the abandoned request never completes an upload nor writes into the caller's buffer, and past
``_MAX_STUCK`` abandoned requests still blocked, new data calls fail at once.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from tierckpt_core.errors import (
    BlockMismatchError,
    IntegrityError,
    InvalidNameError,
    PersistentTierError,
)
from tierckpt_core.objectstore.base import validate_key
from tierckpt_core.objectstore.s3_clients import (
    RetryableS3Error,
    boto_error,
    crt_error,
    new_boto_client,
    new_crt_client,
)
from tierckpt_core.objectstore.settings import StoreSettings
from tierckpt_core.objectstore.streams import RateLimiter
from tierckpt_core.objectstore.watchdog import Deadline, Expired, run_with_deadline
from tierckpt_core.retrying import log_before_retry

if TYPE_CHECKING:
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

logger = logging.getLogger(__name__)

# Abandoned CRT requests still blocked (each may hold an upload's buffers) beyond which new data
# calls fail at once instead of piling up more.
_MAX_STUCK = 16

_T = TypeVar("_T")


class S3Calls:
    """A bucket and prefix, the clients that reach them, and how each call runs (the base of
    :class:`~tierckpt_core.objectstore.s3.S3Store`, which says what the calls are)."""

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
        self.min_rate = settings.min_rate
        self._limiter = RateLimiter(settings.upload_max_rate) if settings.upload_max_rate else None
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._lock = threading.Lock()
        self._crt: MountpointS3Client | None = None
        self._boto: Any = None
        self._stuck = 0  # abandoned CRT requests whose helper thread has not returned yet
        self._pid = os.getpid()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_lock=None, _crt=None, _boto=None, _stuck=0)
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
            self._stuck = 0
            self._pid = os.getpid()

    def _crt_client(self) -> MountpointS3Client:
        self._check_pid()
        with self._lock:
            if self._crt is None:
                self._crt = new_crt_client(
                    region=self.region,
                    endpoint=self.endpoint,
                    force_path_style=self.force_path_style,
                    max_attempts=self.max_attempts,
                )
            return self._crt

    def _boto_client(self) -> Any:
        self._check_pid()
        with self._lock:
            if self._boto is None:
                self._boto = new_boto_client(
                    region=self.region,
                    endpoint=self.endpoint,
                    force_path_style=self.force_path_style,
                    max_attempts=self.max_attempts,
                    timeout_s=self.timeout_s,
                )
            return self._boto

    def close(self) -> None:
        with self._lock:
            boto, self._boto, self._crt = self._boto, None, None
        if boto is not None:
            boto.close()

    # -- helpers --------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _rel(self, full: str) -> str:
        return full[len(self.prefix) + 1 :] if self.prefix else full

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._full(key)}"

    def _allow(self, nbytes: int) -> float:
        """Seconds a blocking step that moves ``nbytes`` over the network may take."""
        return self.timeout_s + nbytes / self.min_rate

    def _data_call(self, what: str, key: str, fn: Callable[[Deadline], _T]) -> _T:
        """Run one data-path operation under a deadline, mapping CRT errors and retrying
        transient ones (timeouts included)."""
        import tenacity
        from s3torchconnectorclient import S3Exception

        tries = 0

        def attempt() -> _T:
            nonlocal tries
            tries += 1
            with self._lock:
                stuck = self._stuck
            if stuck >= _MAX_STUCK:
                raise PersistentTierError(
                    f"{what} {self._where(key)}: {stuck} earlier S3 requests to "
                    f"{self.endpoint or 'S3'} are still hanging after their timeout "
                    f"(TIERCKPT_S3_TIMEOUT={self.timeout_s:g}s); not sending more until they end"
                )
            try:
                return run_with_deadline(
                    fn,
                    "opening the request",
                    self.timeout_s,
                    name="tierckpt-s3",
                    on_exit=self._helper_exit,
                )
            except S3Exception as e:
                raise crt_error(what, key, self._where(key), self.bucket, e) from e
            except BlockMismatchError:
                raise  # a stored block that does not match its checksum stays wrong
            except IntegrityError as e:
                # A body of the wrong size: a cut-short transfer is worth another try; a stored
                # object of the wrong size stays wrong, and says so after the last one.
                if tries >= self.max_attempts:
                    raise
                raise RetryableS3Error(f"{what} {self._where(key)}: {e}") from e
            except Expired as e:
                with self._lock:
                    self._stuck += 1
                    self._crt = None  # the next attempt gets fresh connections
                raise RetryableS3Error(
                    f"{what} {self._where(key)} timed out: {e} (TIERCKPT_S3_TIMEOUT="
                    f"{self.timeout_s:g}s, plus the bytes in flight at TIERCKPT_S3_MIN_RATE="
                    f"{self.min_rate:.0f} B/s); the request was abandoned"
                ) from None

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception_type(RetryableS3Error),
            stop=tenacity.stop_after_attempt(self.max_attempts),
            wait=tenacity.wait_exponential(multiplier=0.2, max=10.0),
            before_sleep=log_before_retry(logger, logging.WARNING, self.max_attempts),
            reraise=True,
        )
        return retrying(attempt)

    def _helper_exit(self, abandoned: bool) -> None:
        if abandoned:
            with self._lock:
                self._stuck -= 1

    def _control(self, what: str, key: str | None, fn: Callable[[Any], _T]) -> _T:
        from botocore.exceptions import BotoCoreError, ClientError

        client = self._boto_client()
        try:
            return fn(client)
        except (ClientError, BotoCoreError) as e:
            where = self._where(key) if key is not None else self.url
            raise boto_error(
                what,
                key,
                where,
                e,
                bucket=self.bucket,
                endpoint=self.endpoint,
                timeout_s=self.timeout_s,
                max_attempts=self.max_attempts,
            ) from e
