"""What every read source is, and what it yields: a step's files, read by range.

A :class:`Source` is where one load reads one step from (``read_plan`` picks it once, before
``read_metadata`` returns): this node's memory (``memory``), the peers that hold the step
(``peers``), or the persistent tier (``persistent``). Each gives the step's metadata and opens its
files as :class:`StepFiles`, which the reader copies items out of. A source that read the step
from elsewhere than this node's memory has the daemon bring it into memory afterwards, in the
background (:class:`MemoryFill`), so that the next restore is local.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Protocol

import torch

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_core.errors import TierCkptError

logger = logging.getLogger(__name__)


class StepFiles(Protocol):
    """A step's files, read by range (``files.LocalFiles``, ``streamed.StreamedFiles``).

    ``prefetch`` (when ``prefetches``): everything a load reads, announced at once, each
    ``(ref, target)`` straight into ``target`` where it can; ``read_into`` then says whether it
    did. ``fetched``: the files of a step spanning nodes that this rank needed and other nodes held.
    """

    where: str
    fetched: set[str]
    prefetches: bool

    def prefetch(self, wants: list[tuple[ShardRef, torch.Tensor | None]]) -> None: ...

    def region(self, name: str, offset: int, length: int, what: str) -> torch.Tensor: ...

    def read_bytes(self, name: str, offset: int, length: int, what: str) -> bytes: ...

    def read_into(self, name: str, offset: int, length: int, target: torch.Tensor) -> bool: ...

    def close(self) -> None: ...


class Source(Protocol):
    """Where a load reads its step from. ``filling``: the thread in which the daemon brings the
    step into this node's memory after a read from elsewhere (None: nothing to bring)."""

    @property
    def filling(self) -> threading.Thread | None: ...

    def metadata(self, namespace: str, step: int) -> str: ...

    def open_files(
        self, namespace: str, step: int, refs: list[ShardRef]
    ) -> contextlib.AbstractContextManager[StepFiles]: ...


class MemoryFill:
    """After a load read a step from elsewhere (the persistent tier, peers): the daemon brings
    the step into this node's memory in the background, for the next restore (:attr:`filling`)."""

    def __init__(self, config: ClientConfig) -> None:
        self.config = config
        self.filling: threading.Thread | None = None
        self._filling_for: tuple[str, int] | None = None

    def fill_memory(self, namespace: str, step: int) -> None:
        """Have the daemon hydrate the step (after this load's reads: the two do not share the
        bandwidth), in a thread; the load does not wait for it. Once per step and source."""
        if self.filling is not None and self._filling_for == (namespace, step):
            return
        self._filling_for = (namespace, step)

        def run() -> None:
            try:
                with DaemonClient(self.config) as daemon:
                    daemon.hydrate(namespace, step)
            except TierCkptError as e:
                logger.warning(
                    "%s/step %d: could not bring it into this node's memory for the next "
                    "restore: %s",
                    namespace,
                    step,
                    e,
                )
                return
            logger.info("%s/step %d is in this node's memory for the next restore", namespace, step)

        self.filling = threading.Thread(target=run, name="tierckpt-fill-memory", daemon=True)
        self.filling.start()
