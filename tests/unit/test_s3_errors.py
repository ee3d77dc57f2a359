"""The S3 clients' errors, in the words an operator reads (status, the log, the CLI): the CRT
client's own text, as it raised it against an endpoint that was down (recorded from a run
against a stopped SeaweedFS; the integration test is tests/integration/test_s3_faults.py)."""

from __future__ import annotations

from tierckpt_core.errors import NotFoundError, PersistentTierError
from tierckpt_core.objectstore.s3_clients import RetryableS3Error, crt_error

WHERE = "s3://ckpt/prod/job/step_000000000005/COMMITTED"
REFUSED = (
    "Client error: Unknown CRT error: CRT error 1047: aws-c-io: "
    "AWS_IO_SOCKET_CONNECTION_REFUSED, socket connection refused."
)


def test_network_errors_read_in_words_and_stay_retryable() -> None:
    e = crt_error("checking", "k", WHERE, "ckpt", Exception(REFUSED))
    assert isinstance(e, RetryableS3Error)
    assert str(e) == (
        f"checking {WHERE} failed: the S3 endpoint refused the connection (is it running, at the "
        "address TIERCKPT_S3_ENDPOINT gives where it is set?) [AWS_IO_SOCKET_CONNECTION_REFUSED]"
    )
    dns = "Client error: CRT error 1059: aws-c-io: AWS_IO_DNS_INVALID_NAME, Host name was invalid"
    assert "host name does not resolve [AWS_IO_DNS_INVALID_NAME]" in str(
        crt_error("checking", "k", WHERE, "ckpt", Exception(dns))
    )
    # An AWS_IO_ code without words keeps the client's text, still retried.
    other = "Client error: CRT error 1051: aws-c-io: AWS_IO_SOMETHING_NEW, new."
    e = crt_error("checking", "k", WHERE, "ckpt", Exception(other))
    assert isinstance(e, RetryableS3Error) and "AWS_IO_SOMETHING_NEW, new." in str(e)


def test_what_is_not_the_network_is_classified_as_before() -> None:
    missing = crt_error("reading", "k", WHERE, "ckpt", Exception("The key does not exist"))
    assert isinstance(missing, NotFoundError)
    # The CRT's words where no credentials are found at all: said as boto's are, and not
    # retried (it was a RetryableS3Error, tried five times, its raw words shown).
    none = crt_error(
        "checking",
        "k",
        WHERE,
        "ckpt",
        Exception("Client error: No signing credentials available, see CRT debug logs"),
    )
    assert not isinstance(none, RetryableS3Error)
    assert f"checking {WHERE} failed: no S3 credentials found (set AWS_ACCESS_KEY_ID" in str(none)
    denied = crt_error("reading", "k", WHERE, "ckpt", Exception("Access Denied (403)"))
    assert isinstance(denied, PersistentTierError) and not isinstance(denied, RetryableS3Error)
    assert "access denied" in str(denied)
