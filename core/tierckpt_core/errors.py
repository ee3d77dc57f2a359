"""The exception tree shared by the client and the daemon.

All errors raised by tierckpt derive from :class:`TierCkptError`::

    TierCkptError
    ├── UnavailableError            transient: the other side did not answer; a retry may work
    │   ├── DaemonUnavailableError  the local daemon cannot be reached or did not answer in time
    │   ├── PeerUnavailableError    a peer daemon cannot be reached or did not answer in time
    │   └── PersistentTierUnavailableError   the persistent tier timed out, throttled or
    │                               failed with a 5xx (also a PersistentTierError)
    ├── InvalidNameError            a namespace, step or file name breaks the naming rules (also ValueError)
    ├── NotFoundError
    │   ├── NamespaceNotFoundError  the daemon holds nothing for this namespace
    │   ├── StepNotFoundError       no such step (or no committed step, for "latest")
    │   └── LeaseNotFoundError      the lease expired or was never granted
    ├── CapacityExceededError       the memory tier cannot fit the request even after safe eviction
    ├── StepStateError              the step is in the wrong state (commit with missing files, ...)
    │   ├── StagingRaceError        a tensor changed while an asynchronous stage copied it (the
    │                               loop did not wait for ``staging_completion``): that save fails
    │   └── NotReplicatedError      a save that waits for its replicas: the step is committed,
    │                               and some share has none (yet)
    ├── CheckpointFormatError       stored metadata or layout is malformed or does not match the load
    │   └── IntegrityError          stored bytes do not match their recorded checksum
    │       └── BlockMismatchError  a block received or copied did not match the checksum taken
    │                               when it was written (names the file, block and source)
    ├── PersistentTierError         the persistent tier (S3, file system) failed or is misconfigured
    ├── ProtocolError               a request or answer that does not follow the wire protocol
    │   └── NotAMemberError         a request names an address that is not a member of the peer
    │                               ring (the peer token goes only to members)
    ├── ForbiddenError              a local-only route was called over the TCP port (or a peer
    │   │                           route on the Unix socket)
    │   └── NamespaceOwnerError     the namespace (or its step) belongs to another identity: a
    │                               caller of another uid, or a peer's copy of a step this node
    │                               committed itself
    └── UnauthorizedError           a peer route was called without the right peer token

The daemon reports errors as JSON ``{"code": "...", "detail": "..."}``; :data:`ERROR_CODES` maps the
stable ``code`` strings back to these classes, so clients never match on message text. Every class
keeps its message as the only positional argument, which keeps it picklable: DCP ships exceptions
across ranks and into the async checkpoint process.
"""

from __future__ import annotations


class TierCkptError(Exception):
    """Root of all tierckpt errors."""

    code = "internal"
    http_status = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class UnavailableError(TierCkptError):
    """Transient: catch this to retry or fall back whatever the other side was."""

    code = "unavailable"
    http_status = 503


class DaemonUnavailableError(UnavailableError):
    code = "daemon_unavailable"
    http_status = 503


class InvalidNameError(TierCkptError, ValueError):
    code = "invalid_name"
    http_status = 422


class NotFoundError(TierCkptError):
    code = "not_found"
    http_status = 404


class NamespaceNotFoundError(NotFoundError):
    code = "namespace_not_found"


class StepNotFoundError(NotFoundError):
    code = "step_not_found"


class LeaseNotFoundError(NotFoundError):
    code = "lease_not_found"


class CapacityExceededError(TierCkptError):
    code = "capacity_exceeded"
    http_status = 507


class StepStateError(TierCkptError):
    code = "step_state"
    http_status = 409


class NotReplicatedError(StepStateError):
    """A save with ``wait="replicated"``: the step is committed (in memory, and wherever else it
    goes: an upload is not undone), but some share has no replica, or not within the wait."""

    code = "not_replicated"


class StagingRaceError(StepStateError):
    """A tensor of the state was changed in place (its version counter moved) between
    ``stage()`` and the end of its asynchronous copy: the training loop changed it before
    waiting for ``staging_completion``. The save fails rather than commit a torn step."""

    code = "staging_race"


class CheckpointFormatError(TierCkptError):
    code = "checkpoint_format"
    http_status = 422


class ProtocolError(TierCkptError):
    code = "protocol"
    http_status = 400


class NotAMemberError(ProtocolError):
    """An address a request names (a commit's node, a prepare's decider) is not a member of the
    ring: nothing is sent to it, since every peer request carries the cluster-wide token."""

    code = "not_a_member"


class IntegrityError(CheckpointFormatError):
    code = "integrity"


class BlockMismatchError(IntegrityError):
    """A block of a stored file, received or copied, did not match the checksum taken when it was
    written (raised by :mod:`tierckpt_core.verified` as the block lands). ``file``, ``block`` and
    ``source`` say which and from where: a reader may try another copy of the file (another peer),
    but a store must not retry the same one (a stored block that is wrong stays wrong). The three
    are keywords, so the message stays the only positional argument and the error pickles whole."""

    code = "block_mismatch"

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        block: int | None = None,
        source: str | None = None,
    ) -> None:
        super().__init__(message)
        self.file = file
        self.block = block
        self.source = source


class PersistentTierError(TierCkptError):
    code = "persistent_tier"
    http_status = 502


class ForbiddenError(TierCkptError):
    code = "forbidden"
    http_status = 403


class NamespaceOwnerError(ForbiddenError):
    """A namespace belongs to the identity that first committed it on a node (``uid:<n>`` of
    the trainer, see docs/security.md): another caller, or another owner's copy from a peer, is
    refused; so is a peer's copy of a step this node committed itself."""

    code = "namespace_owner"


class UnauthorizedError(TierCkptError):
    code = "unauthorized"
    http_status = 401


class PeerUnavailableError(UnavailableError):
    code = "peer_unavailable"
    http_status = 502


class PersistentTierUnavailableError(PersistentTierError, UnavailableError):
    code = "persistent_tier_unavailable"
    http_status = 502


ERROR_CODES: dict[str, type[TierCkptError]] = {
    cls.code: cls
    for cls in (
        TierCkptError,
        UnavailableError,
        DaemonUnavailableError,
        InvalidNameError,
        NotFoundError,
        NamespaceNotFoundError,
        StepNotFoundError,
        LeaseNotFoundError,
        CapacityExceededError,
        StepStateError,
        StagingRaceError,
        NotReplicatedError,
        CheckpointFormatError,
        ProtocolError,
        NotAMemberError,
        ForbiddenError,
        NamespaceOwnerError,
        UnauthorizedError,
        PeerUnavailableError,
        IntegrityError,
        BlockMismatchError,
        PersistentTierError,
        PersistentTierUnavailableError,
    )
}


def error_from_code(code: str, detail: str) -> TierCkptError:
    """Build the exception for a daemon error ``code``; unknown codes become the root class."""
    return ERROR_CODES.get(code, TierCkptError)(detail)
