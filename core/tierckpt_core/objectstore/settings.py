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
