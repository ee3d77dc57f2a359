"""How to reach the persistent tier: S3 endpoint, region, timeouts, retries, upload rate."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlparse

from tierckpt_core.errors import PersistentTierError


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
    upload_max_rate: float | None = None  # bytes/s over all uploads of the store; None: no cap
    # The slowest transfer that is not a stall: the CRT client buffers a whole upload and sends it
    # at close, so completing an upload of n bytes may take timeout_s + n / min_rate seconds.
    min_rate: float = 4 * 1024 * 1024

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StoreSettings:
        """Read ``TIERCKPT_S3_ENDPOINT``, ``TIERCKPT_S3_REGION`` (else ``AWS_REGION``,
        ``AWS_DEFAULT_REGION``), ``TIERCKPT_S3_FORCE_PATH_STYLE``, ``TIERCKPT_S3_TIMEOUT``,
        ``TIERCKPT_S3_MAX_ATTEMPTS`` and ``TIERCKPT_S3_MIN_RATE`` (bytes/s, K/M/G suffixes)."""
        env = os.environ if env is None else env
        # Each refusal names its own variable: "invalid TIERCKPT_S3_TIMEOUT '0': ..." (the
        # daemon reports it under that name, not the persist URL's whose check read it).
        named = [
            n for n in ("TIERCKPT_S3_REGION", "AWS_REGION", "AWS_DEFAULT_REGION") if env.get(n)
        ]
        region = env[named[0]] if named else cls.region
        path_style = env.get("TIERCKPT_S3_FORCE_PATH_STYLE", "").strip().lower()
        timeout_s = _positive(env, "TIERCKPT_S3_TIMEOUT", float, cls.timeout_s, "seconds > 0")
        max_attempts = _positive(
            env, "TIERCKPT_S3_MAX_ATTEMPTS", int, cls.max_attempts, "a whole number >= 1"
        )
        min_rate = _parse_rate(env.get("TIERCKPT_S3_MIN_RATE"), cls.min_rate)
        endpoint = env.get("TIERCKPT_S3_ENDPOINT") or None
        if endpoint is not None:
            check_endpoint(endpoint)
        check_region(region, named[0] if named else None)
        return cls(
            endpoint=endpoint,
            region=region,
            force_path_style=path_style in ("1", "true", "yes", "on"),
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            min_rate=min_rate,
        )


def check_endpoint(endpoint: str) -> None:
    """Refuse an endpoint that the S3 clients would refuse only on their first call (in a
    background thread): it needs a scheme, ``http://`` or ``https://``, and a host."""
    why = None
    try:
        parsed = urlparse(endpoint)
        parsed.port  # noqa: B018 (raises on a port that is not a number in range)
    except ValueError as e:
        why = str(e)
    else:
        if parsed.scheme not in ("http", "https"):
            why = "it needs the scheme, http:// or https://"
        elif not parsed.hostname:
            why = "it names no host"
        else:
            try:
                from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url
            except ImportError:  # no boto3 here (a trainer): the syntax check above is all
                pass
            else:
                if not (is_valid_endpoint_url(endpoint) or is_valid_ipv6_endpoint_url(endpoint)):
                    why = "boto3 refuses it"
    if why is not None:
        raise PersistentTierError(
            f"invalid TIERCKPT_S3_ENDPOINT {endpoint!r}: {why}; e.g. 'http://127.0.0.1:9000' "
            "or 'https://s3.us-east-1.amazonaws.com'"
        )


def check_region(region: str, name: str | None = None) -> None:
    """Refuse a region name boto3 would refuse on its first call (``name``: the variable it
    came from)."""
    try:
        from botocore.utils import validate_region_name
    except ImportError:
        return
    try:
        validate_region_name(region)
    except ValueError:
        where = name or "TIERCKPT_S3_REGION, else AWS_REGION or AWS_DEFAULT_REGION"
        raise PersistentTierError(
            f"invalid {where} {region!r}: an S3 region name, e.g. 'us-east-1'"
            if name
            else f"invalid S3 region {region!r} ({where}): e.g. 'us-east-1'"
        ) from None


_N = TypeVar("_N", int, float)


def _positive(env: Mapping[str, str], name: str, kind: type[_N], default: _N, what: str) -> _N:
    """``env[name]`` as a finite ``kind`` above zero (``default`` if unset); else an error naming
    it (``nan`` and ``inf`` too: a timeout must end)."""
    text = env.get(name)
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = kind(0)
    if not 0 < value < math.inf:
        raise PersistentTierError(f"invalid {name} {text!r}: {what}")
    return value


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def _parse_rate(text: str | None, default: float) -> float:
    if not text:
        return default
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = -1.0
    if value <= 0:
        raise PersistentTierError(
            f"invalid TIERCKPT_S3_MIN_RATE {text!r}: bytes per second > 0, e.g. 4M or 500K"
        )
    return value
