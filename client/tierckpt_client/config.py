"""Client configuration: explicit arguments win over ``TIERCKPT_*`` environment variables."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from tierckpt_core.setting_names import PREFIX, SETTINGS, unknown_settings

logger = logging.getLogger(__name__)

DEFAULT_SHM_DIR = Path("/dev/shm/tierckpt")


@dataclass(frozen=True)
class ClientConfig:
    """How a trainer process reaches its node's daemon.

    Attributes:
        socket: the daemon's Unix socket (``TIERCKPT_SOCKET``; default ``<TIERCKPT_SHM_DIR>/daemon.sock``).
        timeout_s: bound on every daemon call (``TIERCKPT_TIMEOUT``). A lease of fresh memory
            allocates pages, which takes about a second per few GB, so keep this generous.
        connect_timeout_s: bound on connecting to the socket (``TIERCKPT_CONNECT_TIMEOUT``).
        hydrate_timeout_s: bound on bringing a step from the persistent tier into memory
            (``TIERCKPT_HYDRATE_TIMEOUT``): a download of the whole step.
        persist_url: the persistent tier (``TIERCKPT_PERSIST_URL``, the daemon's setting), used
            to restore, and to save in degraded mode, when the daemon cannot be reached. S3
            options come from ``TIERCKPT_S3_*`` and the AWS credential chain.
        verify_reads: check tensors read from this node's memory against the checksums taken
            when they were written (``TIERCKPT_VERIFY_READS``, default on; ``0`` turns it off
            for tensors; bytes items, which are unpickled, are always checked, and so are the
            loads of the Lightning integrations, whose pickled state is a tensor:
            :meth:`verifying`).
        pin_memory: register the tier files a save of CUDA tensors stages into, and a restore
            into CUDA tensors reads from, as page-locked host memory (``cudaHostRegister``), so
            that the device copies are DMA at the link's speed (``TIERCKPT_PIN_MEMORY``,
            default on; no effect without CUDA). Each recycled file is registered once per
            process, the first time it is used.
        restore_direct: read a durable step that is in no node's memory straight from the
            persistent tier at ``persist_url`` into the destination tensors, verified, while the
            daemon brings it into memory afterwards for the next restore
            (``TIERCKPT_RESTORE_DIRECT``): ``auto`` (default) for ``s3://`` tiers, ``on`` for any,
            ``off`` to have the daemon hydrate the step first, as without ``persist_url``. A step
            that peers hold and this node lost is read from them straight into the tensors
            (the daemon hands over its connections) unless it is ``off``.
        prelease: after each ``async_save`` (THREAD mode) ask the daemon for the next save's
            file, put in place when this save commits, so that the next ``stage`` needs no
            daemon round trip (``TIERCKPT_PRELEASE``, default on; ``0`` leases in ``stage``).
        async_staging: where the caller waits for ``staging_completion`` itself
            (:class:`~tierckpt_client.Checkpointer`, and the Hugging Face integration through
            it), stage asynchronously: ``save`` returns before the copy into the tier is done, and the next
            optimizer step waits for it (``TIERCKPT_ASYNC_STAGING``, default on; ``0`` copies
            before ``save`` returns). A bare ``TieredStorageWriter`` takes its own argument.
        pause_gc: pause Python's cyclic garbage collector during a stage, a load's read, and
            the ``Checkpointer``'s loads and its saves' planning (``TIERCKPT_PAUSE_GC``, default
            on; ``0`` leaves it alone): with thousands of tensors its collections were a large
            part of the stall and of a restore. A collector the caller disabled stays disabled.
    """

    socket: Path = DEFAULT_SHM_DIR / "daemon.sock"
    timeout_s: float = 120.0
    connect_timeout_s: float = 5.0
    hydrate_timeout_s: float = 3600.0
    persist_url: str | None = None
    verify_reads: bool = True
    pin_memory: bool = True
    restore_direct: str = "auto"
    prelease: bool = True
    async_staging: bool = True
    pause_gc: bool = True

    def verifying(self) -> ClientConfig:
        """This configuration with ``verify_reads`` on: for a load whose tensor is unpickled
        (the Lightning integrations keep the checkpoint's other state as ``torch.save`` bytes in
        a uint8 tensor), which must never read bytes that were not verified."""
        return self if self.verify_reads else replace(self, verify_reads=True)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> ClientConfig:
        if env is None:
            _warn_unknown(os.environ)
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        if "TIERCKPT_SOCKET" in env:
            values["socket"] = Path(env["TIERCKPT_SOCKET"])
        elif "TIERCKPT_SHM_DIR" in env:
            values["socket"] = Path(env["TIERCKPT_SHM_DIR"]) / "daemon.sock"
        if env.get("TIERCKPT_PERSIST_URL"):
            values["persist_url"] = env["TIERCKPT_PERSIST_URL"]
        for name, var in (
            ("verify_reads", "TIERCKPT_VERIFY_READS"),
            ("prelease", "TIERCKPT_PRELEASE"),
            ("pin_memory", "TIERCKPT_PIN_MEMORY"),
            ("async_staging", "TIERCKPT_ASYNC_STAGING"),
            ("pause_gc", "TIERCKPT_PAUSE_GC"),
        ):
            flag = _flag(env, var)
            if flag is not None:
                values[name] = flag
        direct = env.get("TIERCKPT_RESTORE_DIRECT", "").strip().lower()
        if direct:
            values["restore_direct"] = direct
        for name, var in (
            ("timeout_s", "TIERCKPT_TIMEOUT"),
            ("connect_timeout_s", "TIERCKPT_CONNECT_TIMEOUT"),
            ("hydrate_timeout_s", "TIERCKPT_HYDRATE_TIMEOUT"),
        ):
            if var in env:
                try:
                    values[name] = float(env[var])
                except ValueError:
                    raise ValueError(f"{var}={env[var]!r} is not a number of seconds") from None
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown ClientConfig fields: {sorted(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "socket" in values:
            values["socket"] = Path(values["socket"])
        config = replace(cls(), **values)
        config.reads_direct()  # a bad restore_direct fails here
        return config

    def reads_direct(self) -> bool:
        """Whether a durable step in no node's memory is read straight from ``persist_url``."""
        mode = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off"}.get(
            self.restore_direct, self.restore_direct
        )
        if mode not in ("auto", "on", "off"):
            raise ValueError(
                f"TIERCKPT_RESTORE_DIRECT={self.restore_direct!r} is not auto, on or off"
            )
        if not self.persist_url or mode == "off":
            return False
        return mode == "on" or self.persist_url.startswith("s3://")

    def reads_peers_direct(self) -> bool:
        """Whether a step that peers hold and this node lost is read from them straight into
        the tensors (through connections the daemon hands over), unless ``restore_direct`` is off."""
        self.reads_direct()  # checks the setting
        return self.restore_direct not in ("off", "0", "false", "no")


def _flag(env: dict[str, str], var: str) -> bool | None:
    """An on/off setting: None when unset or empty."""
    text = env.get(var, "").strip().lower()
    if not text:
        return None
    if text not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(f"{var}={text!r} is not 0 or 1")
    return text in ("1", "true", "yes", "on")


_warned: set[str] = set()
_warned_lock = threading.Lock()


def _warn_unknown(env: Mapping[str, str]) -> None:
    """A WARNING, once per process and name, for each ``TIERCKPT_*`` variable that is no
    setting of any part of tierckpt (a misspelt one is otherwise silently ignored)."""
    if not any(n.startswith(PREFIX) and n not in SETTINGS for n in env):
        return  # (the common case: nothing to compare)
    for message in unknown_settings(env):
        with _warned_lock:
            if message in _warned:
                continue
            _warned.add(message)
        logger.warning("%s; it is ignored", message)
