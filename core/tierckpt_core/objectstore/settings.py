"""How to reach the persistent tier: S3 endpoint, region, timeouts, retries, upload rate."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

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
        min_rate = _parse_rate(env.get("TIERCKPT_S3_MIN_RATE"), cls.min_rate)
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
            min_rate=min_rate,
        )


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
