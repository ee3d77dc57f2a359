"""Which target a save writes to, on one rank: the save side's ``read_plan``.

This node's memory tier (``memory``), unless this rank cannot use its daemon (it cannot be
reached, or has no room: ``degraded``) or the coordinator's global plan sends the whole save to
the persistent tier (``persistent``, opened once, with one WARNING per cause). The choice is made
once per save, the same on every rank (:meth:`Targets.chosen`); ``on_unavailable="raise"`` makes
a daemon that cannot be used fail the save instead.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp.targets.base import OutFile, SaveTarget
from tierckpt_client.dcp.targets.memory import MemoryTier
from tierckpt_client.dcp.targets.persistent import PersistentTier
from tierckpt_core.errors import (
    CapacityExceededError,
    DaemonUnavailableError,
    TierCkptError,
)

logger = logging.getLogger(__name__)

_warned: set[str] = set()


class Targets:
    """One writer's targets and the choice between them. ``discard`` gives back a file leased
    from the memory tier that a save sent to the persistent tier will not seal."""

    def __init__(
        self,
        daemon: DaemonClient,
        config: ClientConfig,
        *,
        on_unavailable: str,
        overwrite: bool,
        discard: Callable[[str, OutFile], None],
    ) -> None:
        self.config = config
        self.on_unavailable = on_unavailable
        self.overwrite = overwrite
        self.discard = discard
        self.memory = MemoryTier(daemon, overwrite=overwrite)
        self.persistent: PersistentTier | None = None
        self.degraded = False  # this rank cannot use its daemon

    def hand_over(self, daemon: DaemonClient, discard: Callable[[str, OutFile], None]) -> Targets:
        """The same choice for the writer's pickled copy: a fresh connection to the daemon, the
        persistent tier re-opened (with its one warning) where it is needed."""
        moved = Targets(
            daemon,
            self.config,
            on_unavailable=self.on_unavailable,
            overwrite=self.overwrite,
            discard=discard,
        )
        moved.degraded = self.degraded
        return moved

    def degrade(self, cause: TierCkptError) -> PersistentTier:
        """Switch this save to the persistent tier, or re-raise ``cause`` if the policy says no."""
        url = self.config.persist_url
        if self.on_unavailable != "persist" or not url:
            if self.on_unavailable == "persist":
                cause.message += (
                    " (set TIERCKPT_PERSIST_URL in the trainer to save straight to the persistent "
                    "tier instead)"
                )
                cause.args = (cause.message,)
            raise cause
        key = f"{type(cause).__name__}:{url}"
        if key not in _warned:
            _warned.add(key)
            logger.warning("%s; saving straight to the persistent tier %s", cause, url)
        self.degraded = True
        if self.persistent is None:
            self.persistent = PersistentTier(url, discard=self.discard, overwrite=self.overwrite)
        return self.persistent

    def new_file(self, namespace: str, rank: int, size: int) -> OutFile:
        """A file to stage into: leased from the memory tier, or (degraded) private memory."""
        try:
            return self.memory.new_file(namespace, rank, "", size)
        except (DaemonUnavailableError, CapacityExceededError) as e:
            return self.degrade(e).new_file(namespace, rank, "", size)

    def reserve(self, namespace: str, rank: int, size: int) -> OutFile | None:
        """A plain save's file, leased from the memory tier while the ranks plan; None when it
        cannot be (this rank is degraded now, or the policy raised)."""
        try:
            return self.memory.new_file(namespace, rank, "", size)
        except (DaemonUnavailableError, CapacityExceededError) as e:
            self.degrade(e)
            return None

    def chosen(self, namespace: str, step: int, direct: bool) -> SaveTarget:
        """The target the coordinator chose for this save (``direct``: the persistent tier), the
        same on every rank."""
        if not direct:
            return self.memory
        if self.persistent is None:
            return self.degrade(
                DaemonUnavailableError(
                    f"{namespace}/step {step}: another rank cannot use its daemon, so this save "
                    "goes to the persistent tier"
                )
            )
        return self.persistent
