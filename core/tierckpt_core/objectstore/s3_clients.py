"""The two S3 SDKs behind :class:`~tierckpt_core.objectstore.s3.S3Store`: how their clients are
made (the CRT client of s3torchconnectorclient for data, boto3 for control calls), and what their
failures mean to the persistent tier: their exceptions translated into the error tree (not found,
no bucket, access denied, timed out), and which are worth another try (:class:`RetryableS3Error`:
network, throttling, 5xx).

The CRT client has one exception type whose message is the only thing that tells errors apart;
boto3 carries an error code and an HTTP status. Both are read here, in one place, so that
:mod:`~tierckpt_core.objectstore.s3` only says which call failed on which key. Both SDKs are
imported lazily, when a client is made or an error translated.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from tierckpt_core.errors import NotFoundError, PersistentTierError, PersistentTierUnavailableError
from tierckpt_core.objectstore.streams import CHUNK_SIZE

if TYPE_CHECKING:
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client


def new_crt_client(
    *, region: str, endpoint: str | None, force_path_style: bool, max_attempts: int
) -> MountpointS3Client:
    """A CRT client for the data path (uploads and downloads in ``CHUNK_SIZE`` parts)."""
    from s3torchconnectorclient._mountpoint_s3_client import MountpointS3Client

    try:
        return MountpointS3Client(
            region=region,
            user_agent_prefix="tierckpt",
            part_size=CHUNK_SIZE,
            endpoint=endpoint,
            force_path_style=force_path_style,
            max_attempts=max_attempts,
        )
    except ValueError as e:
        raise _unusable(endpoint, region, e) from e


def new_boto_client(
    *,
    region: str,
    endpoint: str | None,
    force_path_style: bool,
    max_attempts: int,
    timeout_s: float,
) -> Any:
    """A boto3 S3 client for the control calls (list, head, delete), every call bounded."""
    import boto3
    from botocore.config import Config

    config = Config(
        region_name=region,
        s3={"addressing_style": "path" if force_path_style else "auto"},
        connect_timeout=min(timeout_s, 10.0),
        read_timeout=timeout_s,
        # total_max_attempts counts the first try; botocore's max_attempts would not.
        retries={"total_max_attempts": max_attempts, "mode": "standard"},
        # We checksum every byte ourselves (xxh3); S3-compatible servers vary in their support
        # of the newer flexible checksums.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    try:
        return boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
    except ValueError as e:  # botocore's refusals of an endpoint or region are ValueErrors
        raise _unusable(endpoint, region, e) from e


def _unusable(endpoint: str | None, region: str, e: Exception) -> PersistentTierError:
    """A typed error for an S3 client that cannot be made: callers that keep the memory tier
    working when the persistent tier fails (``latest``, the uploader) see a persistent-tier
    failure, not an internal error."""
    return PersistentTierError(
        f"cannot make an S3 client for endpoint {endpoint or '(default)'}, region {region} "
        f"(TIERCKPT_S3_ENDPOINT, TIERCKPT_S3_REGION): {e}"
    )


NO_CREDENTIALS = (
    "no S3 credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or attach "
    "a role)"
)


class RetryableS3Error(PersistentTierUnavailableError):
    """A transient data-path failure (network, throttling, 5xx): retried by tenacity."""


# Substrings of the CRT client's S3Exception messages. Checked in lowercase.
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


# The CRT client's network errors (``Client error: Unknown CRT error: CRT error 1047: aws-c-io:
# AWS_IO_SOCKET_CONNECTION_REFUSED, socket connection refused.``), in words; the code is kept.
_CRT_NETWORK = re.compile(r"\b(AWS_IO_[A-Z_]+)\b")
_CRT_NETWORK_WORDS = {
    "AWS_IO_SOCKET_CONNECTION_REFUSED": "the S3 endpoint refused the connection (is it running, "
    "at the address TIERCKPT_S3_ENDPOINT gives where it is set?)",
    "AWS_IO_SOCKET_TIMEOUT": "connecting to the S3 endpoint timed out",
    "AWS_IO_SOCKET_CLOSED": "the S3 endpoint closed the connection",
    "AWS_IO_SOCKET_NETWORK_DOWN": "the network to the S3 endpoint is down",
    "AWS_IO_SOCKET_NO_ROUTE_TO_HOST": "there is no route to the S3 endpoint",
    "AWS_IO_DNS_INVALID_NAME": "the S3 endpoint's host name does not resolve",
    "AWS_IO_DNS_QUERY_FAILED": "the S3 endpoint's host name could not be resolved",
    "AWS_IO_TLS_ERROR_NEGOTIATION_FAILURE": "the TLS handshake with the S3 endpoint failed (an "
    "https:// endpoint that serves plain HTTP, or a certificate this node does not trust)",
}


def crt_error(
    what: str, key: str, where: str, bucket: str, exc: Exception
) -> PersistentTierError | NotFoundError:
    """The error for the CRT client's ``exc`` from ``what`` on ``key`` (at ``where``)."""
    msg = str(exc)
    low = msg.lower()
    network = _CRT_NETWORK.search(msg)
    if network and network.group(1) in _CRT_NETWORK_WORDS:
        words = _CRT_NETWORK_WORDS[network.group(1)]
        return RetryableS3Error(f"{what} {where} failed: {words} [{network.group(1)}]")
    if any(s in low for s in _CRT_NOT_FOUND):
        return NotFoundError(f"object {key!r} not found ({where})")
    if any(s in low for s in _CRT_NO_BUCKET):
        return PersistentTierError(
            f"{what} {where} failed: bucket {bucket!r} does not exist ({msg})"
        )
    if "no signing credentials" in low or "no credentials" in low:
        # None configured, or the provider (instance metadata, STS) did not answer: the upload
        # or read that gets this is retried by its caller, not here five times.
        return PersistentTierError(
            f"{what} {where} failed: {NO_CREDENTIALS}, or the credential provider (instance "
            f"metadata, STS) did not answer ({msg})"
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
    return RetryableS3Error(f"{what} {where} failed: {msg}")


def boto_error(
    what: str,
    key: str | None,
    where: str,
    exc: Exception,
    *,
    bucket: str,
    endpoint: str | None,
    timeout_s: float,
    max_attempts: int,
) -> Exception:
    """The error for boto3's ``exc`` from ``what`` on ``key`` (None: the bucket itself), at
    ``where``; an exception that is not boto3's is returned as it is."""
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectTimeoutError,
        NoCredentialsError,
        ReadTimeoutError,
    )

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        code = str(err.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket" or (key is None and status == 404):
            return PersistentTierError(
                f"{what} {where} failed: bucket {bucket!r} does not exist"
                + (f" at {endpoint}" if endpoint else "")
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
        return PersistentTierError(f"{what} {where} failed: {NO_CREDENTIALS}")
    if isinstance(exc, (ReadTimeoutError, ConnectTimeoutError)):
        return PersistentTierError(
            f"{what} {where} timed out: {exc} (TIERCKPT_S3_TIMEOUT={timeout_s:g}s, "
            f"{max_attempts} attempt(s))"
        )
    if isinstance(exc, BotoCoreError):
        return PersistentTierError(f"{what} {where} failed: {exc}")
    return exc
