"""Checks at start that say what the settings mean before anything is served: variables that are
no setting (a misspelt name is otherwise silently ignored), and a capacity that does not fit the
tier's file system or the node's memory, or a tier that is not in memory at all.

Each finding is one WARNING naming what was found; :func:`unknown_settings` refuses instead under
``TIERCKPT_STRICT_SETTINGS=1``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

from tierckpt_core import setting_names
from tierckpt_daemon.config import CAPACITY_FLOOR, DaemonSettings, node_memory_bytes
from tierckpt_daemon.paths import filesystem_of

logger = logging.getLogger(__name__)

PREFIX = setting_names.PREFIX

# Read by other parts than DaemonSettings, and often set in the same environment (a Slurm job's,
# a pod spec shared with the trainers): the S3 tier (tierckpt_core.objectstore.settings), the
# trainers (tierckpt_client.config), the webhook (tierckpt_webhook.server), the Slurm wrapper
# (deploy/slurm). tests/unit/test_startup_checks.py checks this list against their sources.
OTHER_SETTINGS = frozenset(
    {
        "TIERCKPT_S3_ENDPOINT",
        "TIERCKPT_S3_REGION",
        "TIERCKPT_S3_FORCE_PATH_STYLE",
        "TIERCKPT_S3_TIMEOUT",
        "TIERCKPT_S3_MAX_ATTEMPTS",
        "TIERCKPT_S3_MIN_RATE",
        "TIERCKPT_TIMEOUT",
        "TIERCKPT_CONNECT_TIMEOUT",
        "TIERCKPT_HYDRATE_TIMEOUT",
        "TIERCKPT_VERIFY_READS",
        "TIERCKPT_PIN_MEMORY",
        "TIERCKPT_RESTORE_DIRECT",
        "TIERCKPT_PRELEASE",
        "TIERCKPT_ASYNC_STAGING",
        "TIERCKPT_PAUSE_GC",
        "TIERCKPT_WEBHOOK_HOST",
        "TIERCKPT_WEBHOOK_PORT",
        "TIERCKPT_WEBHOOK_TLS_CERT",
        "TIERCKPT_WEBHOOK_TLS_KEY",
        "TIERCKPT_WEBHOOK_MAX_CONNECTIONS",
        "TIERCKPT_WEBHOOK_REQUEST_TIMEOUT_S",
        "TIERCKPT_GROUP",
        "TIERCKPT_KEEP_TIER",
        "TIERCKPT_READY_TIMEOUT",
    }
)


def known_settings() -> frozenset[str]:
    daemon = {
        f"{PREFIX}{name.upper()}"
        for name, f in DaemonSettings.model_fields.items()
        if not f.exclude  # derived fields, never read from the environment
    }
    return frozenset(daemon | OTHER_SETTINGS)


def unknown_settings(env: Mapping[str, str]) -> list[str]:
    """One message per ``TIERCKPT_*`` variable in ``env`` that is no setting, naming the closest
    one (or saying there is none)."""
    return setting_names.unknown_settings(env, known_settings())


def capacity_findings(
    settings: DaemonSettings, node_bytes: int | None = None, fs: tuple[str, str] | None = None
) -> list[str]:
    """What is odd about the capacity and the tier's file system, one sentence each."""
    shm_dir = settings.shm_dir
    cap = settings.capacity_bytes
    node_bytes = node_memory_bytes() if node_bytes is None else node_bytes
    mount, fstype = filesystem_of(shm_dir) if fs is None else fs
    found = []
    if fstype and fstype != "tmpfs":
        found.append(
            f"the tier directory {shm_dir} is on a {fstype} file system ({mount}), not tmpfs: "
            "saves and restores run at the speed of that file system, not of memory; put "
            "TIERCKPT_SHM_DIR on a tmpfs such as /dev/shm"
        )
    if cap < CAPACITY_FLOOR:
        found.append(
            f"TIERCKPT_CAPACITY {settings.capacity} is {cap} bytes, below "
            f"{CAPACITY_FLOOR >> 20} MiB: a tier this small holds no real checkpoint"
        )
    if cap > node_bytes:
        found.append(
            f"TIERCKPT_CAPACITY {settings.capacity} is {_gib(cap)}, more than the "
            f"{_gib(node_bytes)} of memory this daemon may use (the node's, or its cgroup "
            "limit): leases will fail when memory runs out, not when the capacity is reached"
        )
    if fstype == "tmpfs":
        try:
            st = os.statvfs(mount)  # the tier directory may not exist yet
        except OSError:
            st = None
        size = st.f_blocks * st.f_frsize if st is not None else 0
        if st is not None and cap > size:
            found.append(
                f"TIERCKPT_CAPACITY {settings.capacity} is {_gib(cap)}, more than the "
                f"{_gib(size)} tmpfs at {mount} that holds {shm_dir}: a lease past that fails "
                "with 'no space'; size the tmpfs (or the hostPath) or lower the capacity"
            )
    return found


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB ({n} bytes)"


def log_findings(messages: Iterable[str]) -> None:
    for message in messages:
        logger.warning("%s", message)


def check_environment(settings: DaemonSettings, env: Mapping[str, str]) -> list[str]:
    """Warn about what start-up found; returns the unknown variables' messages (which
    ``TIERCKPT_STRICT_SETTINGS`` turns into a refusal)."""
    unknown = unknown_settings(env)
    if not settings.strict_settings:
        log_findings(
            f"{m}; it is ignored (TIERCKPT_STRICT_SETTINGS=1 refuses to start instead)"
            for m in unknown
        )
    log_findings(capacity_findings(settings))
    return unknown
