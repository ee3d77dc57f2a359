"""What every save target is, and what a rank fills for it: :class:`OutFile`.

A :class:`SaveTarget` is where one save's files go (the coordinator's global plan picks it once,
the same on every rank): this node's memory tier (``memory``) or the persistent tier
(``persistent``). A rank asks it for a file to fill (``new_file``), fills it, hands its filled
files over (``write``), and the coordinator commits them (``commit``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierckpt_client.dcp import _arena
from tierckpt_core.errors import StepStateError
from tierckpt_core.protocol import CommitRequest


@dataclass
class OutFile:
    """A file a rank fills for a save: leased from the daemon's memory tier (``lease_id`` and
    ``path``), or private memory (``private``) for a save that goes to the persistent tier.

    Only the path of a leased file is kept (and pickled: PROCESS-mode ``async_save`` hands the file
    to DCP's helper process), so each process maps it through its own mapping cache.

    ``lock_fd``: a claimed pre-lease (``_prelease``) holds ``flock`` on its file through this
    descriptor until the file is sealed or given back (:meth:`unlock`), so that the daemon does not
    take it back meanwhile; it is not pickled.
    """

    name: str
    length: int  # bytes of the file the save uses
    lease_id: str | None = None
    path: str | None = None
    private: _arena.FileMapping | None = None
    segments: list[tuple[int, int, str]] | None = None  # see FileRecord.segments
    lock_fd: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "lock_fd": None}

    def unlock(self) -> None:
        """Let the daemon manage the file again (it was sealed, or is given back)."""
        fd, self.lock_fd = self.lock_fd, None
        if fd is not None:
            os.close(fd)

    def mapping(self) -> _arena.FileMapping:
        if self.path is not None:
            return _arena.map_file(self.path)
        assert self.private is not None
        return self.private


def bytes_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous uint8 CPU tensor, without a copy."""
    array: Any = t.numpy()
    return memoryview(array).cast("B")


def private_file(name: str, size: int) -> OutFile:
    """A file in this process's memory, for a save the persistent tier receives."""
    buffer = torch.empty(size, dtype=torch.uint8)
    return OutFile(name, size, private=_arena.FileMapping(-1, -1, -1, size, buffer))


class SaveTarget(Protocol):
    def begin(self, namespace: str, step: int) -> None:
        """Coordinator, before any rank writes."""

    def new_file(self, namespace: str, rank: int, name: str, size: int) -> OutFile: ...

    def write(
        self, namespace: str, step: int, attempt: str, rank: int, files: list[OutFile]
    ) -> None:
        """Hand the rank's filled files to the target (even none: the rank took part)."""

    def commit(self, namespace: str, step: int, attempt: str, req: CommitRequest) -> None: ...


def overwrite_refused(namespace: str, step: int) -> StepStateError:
    return StepStateError(
        f"{namespace}/step {step} is already committed and the save asked not to replace it "
        "(overwrite=False); save under a new step, or pass overwrite=True"
    )
