"""tierckpt client: talk to the node-local daemon. Torch-free; the DCP classes live in
:mod:`tierckpt_client.dcp`, and :class:`Checkpointer` (which needs torch) is imported on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_core import __version__
from tierckpt_core.errors import (
    CapacityExceededError,
    CheckpointFormatError,
    DaemonUnavailableError,
    IntegrityError,
    InvalidNameError,
    NamespaceNotFoundError,
    NotFoundError,
    PeerUnavailableError,
    PersistentTierError,
    StepNotFoundError,
    StepStateError,
    TierCkptError,
    UnavailableError,
)

if TYPE_CHECKING:
    from tierckpt_client.checkpointer import Checkpointer, SaveFailedError

_LAZY = {"Checkpointer", "SaveFailedError"}


def __getattr__(name: str) -> Any:
    # Lazily, so that ``import tierckpt_client`` (the CLI, the daemon's tools) needs no torch.
    if name in _LAZY:
        from tierckpt_client import checkpointer

        return getattr(checkpointer, name)
    raise AttributeError(f"module 'tierckpt_client' has no attribute {name!r}")


__all__ = [
    "CapacityExceededError",
    "CheckpointFormatError",
    "Checkpointer",
    "ClientConfig",
    "DaemonClient",
    "DaemonUnavailableError",
    "IntegrityError",
    "InvalidNameError",
    "NamespaceNotFoundError",
    "NotFoundError",
    "PeerUnavailableError",
    "PersistentTierError",
    "SaveFailedError",
    "StepNotFoundError",
    "StepStateError",
    "TierCkptError",
    "UnavailableError",
    "__version__",
]
