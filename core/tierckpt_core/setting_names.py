"""Every ``TIERCKPT_*`` environment variable a part of tierckpt reads, so that a misspelt one is
named wherever it is read: the daemon warns at start (or refuses, ``TIERCKPT_STRICT_SETTINGS=1``),
and a trainer's client warns once per process (``tierckpt_client.config``). A name that is no
setting is otherwise silently ignored: ``TIERCKPT_ASYNC_STAGNG=0`` leaves staging asynchronous.

The daemon's own names are derived from its settings model; tests/unit/test_startup_checks.py
checks that this list is exactly those and the other parts' (the client's, the S3 tier's, the
webhook's, the Slurm wrapper's).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

PREFIX = "TIERCKPT_"

SETTINGS = frozenset(
    {
        "TIERCKPT_ASYNC_STAGING",
        "TIERCKPT_BACKGROUND_NICE",
        "TIERCKPT_CAPACITY",
        "TIERCKPT_COMMIT_FANOUT",
        "TIERCKPT_CONNECT_TIMEOUT",
        "TIERCKPT_DECIDER_GONE_S",
        "TIERCKPT_DECISION_RESEND_S",
        "TIERCKPT_DRAIN_TIMEOUT_S",
        "TIERCKPT_GROUP",
        "TIERCKPT_HANDOFF_TIMEOUT_S",
        "TIERCKPT_HEAD_TIMEOUT_S",
        "TIERCKPT_HOST",
        "TIERCKPT_HYDRATE_TIMEOUT",
        "TIERCKPT_KEEP_LAST",
        "TIERCKPT_KEEP_TIER",
        "TIERCKPT_LEASE_TTL_S",
        "TIERCKPT_LOG_JSON",
        "TIERCKPT_LOG_LEVEL",
        "TIERCKPT_METRICS_NAMESPACE_LABELS",
        "TIERCKPT_NODE_NAME",
        "TIERCKPT_PAUSE_GC",
        "TIERCKPT_PEERS",
        "TIERCKPT_PEER_FETCH_MAX_RATE",
        "TIERCKPT_PEER_LIST_TIMEOUT_S",
        "TIERCKPT_PEER_MAX_BODY_BYTES",
        "TIERCKPT_PEER_MAX_RECORD_BYTES",
        "TIERCKPT_PEER_TIMEOUT_S",
        "TIERCKPT_PEER_TLS_CA",
        "TIERCKPT_PEER_TLS_CERT",
        "TIERCKPT_PEER_TLS_KEY",
        "TIERCKPT_PEER_TLS_SERVER_NAME",
        "TIERCKPT_PEER_TOKEN",
        "TIERCKPT_PEER_TOKEN_FILE",
        "TIERCKPT_PERSIST_EVERY",
        "TIERCKPT_PERSIST_KEEP_LAST",
        "TIERCKPT_PERSIST_URL",
        "TIERCKPT_PIN_MEMORY",
        "TIERCKPT_PORT",
        "TIERCKPT_PREFAULT",
        "TIERCKPT_PRELEASE",
        "TIERCKPT_READY_TIMEOUT",
        "TIERCKPT_REPLICAS",
        "TIERCKPT_REPLICATION_CONCURRENCY",
        "TIERCKPT_REPLICATION_INFLIGHT_BYTES",
        "TIERCKPT_REPLICATION_MAX_RATE",
        "TIERCKPT_RESTORE_DIRECT",
        "TIERCKPT_S3_ENDPOINT",
        "TIERCKPT_S3_FORCE_PATH_STYLE",
        "TIERCKPT_S3_MAX_ATTEMPTS",
        "TIERCKPT_S3_MIN_RATE",
        "TIERCKPT_S3_REGION",
        "TIERCKPT_S3_TIMEOUT",
        "TIERCKPT_SHM_DIR",
        "TIERCKPT_SOCKET",
        "TIERCKPT_STRICT_SETTINGS",
        "TIERCKPT_TIMEOUT",
        "TIERCKPT_UPLOAD_CONCURRENCY",
        "TIERCKPT_UPLOAD_MAX_RATE",
        "TIERCKPT_VERIFY_READS",
        "TIERCKPT_WEBHOOK_HOST",
        "TIERCKPT_WEBHOOK_MAX_CONNECTIONS",
        "TIERCKPT_WEBHOOK_PORT",
        "TIERCKPT_WEBHOOK_REQUEST_TIMEOUT_S",
        "TIERCKPT_WEBHOOK_TLS_CERT",
        "TIERCKPT_WEBHOOK_TLS_KEY",
    }
)


def unknown_settings(env: Mapping[str, str], known: Iterable[str] = SETTINGS) -> list[str]:
    """One message per ``TIERCKPT_*`` variable in ``env`` that is no setting, naming the closest
    one (or saying there is none)."""
    known = frozenset(known)
    suffixes = [k.removeprefix(PREFIX) for k in known]  # compared without the shared prefix
    messages = []
    for name in sorted(n for n in env if n.startswith(PREFIX) and n not in known):
        close = difflib.get_close_matches(name.removeprefix(PREFIX), suffixes, n=1, cutoff=0.6)
        hint = f"did you mean {PREFIX}{close[0]}?" if close else "no setting has a similar name"
        messages.append(f"{name} is not a tierckpt setting ({hint})")
    return messages
