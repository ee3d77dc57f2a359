"""tierckpt client: talk to the node-local daemon. Torch-free; the DCP classes live in
:mod:`tierckpt_client.dcp`."""

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

__all__ = [
    "CapacityExceededError",
    "CheckpointFormatError",
    "ClientConfig",
    "DaemonClient",
    "DaemonUnavailableError",
    "IntegrityError",
    "InvalidNameError",
    "NamespaceNotFoundError",
    "NotFoundError",
    "PeerUnavailableError",
    "PersistentTierError",
    "StepNotFoundError",
    "StepStateError",
    "TierCkptError",
    "UnavailableError",
    "__version__",
]
