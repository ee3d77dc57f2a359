"""Tell the node's daemon about corruption a load found, for its metrics, alert and log.

A reader verifies every block it reads; the daemon never sees those reads, so without a report
``tierckpt_verification_failures_total`` stayed 0 while loads fell back past corrupt steps. The
report is best effort (:meth:`DaemonClient.report_corruption`: bounded, never raises): the load's
own error or fallback is what the trainer acts on.
"""

from __future__ import annotations

from typing import Literal

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp.sources import Source
from tierckpt_client.dcp.sources.files import MEMORY_SOURCE
from tierckpt_client.dcp.sources.memory import MemorySource
from tierckpt_client.dcp.sources.peers import PeerSource
from tierckpt_core.errors import BlockMismatchError, IntegrityError
from tierckpt_core.protocol import CorruptionReport

Tier = Literal["memory", "peer", "persistent"]


def tier_of(error: IntegrityError, source: Source | None) -> Tier:
    """Which tier the bad bytes came from: the error says where it read them when it can (a
    read through this node's memory may have gone to the peers), else the source read from."""
    where = error.source if isinstance(error, BlockMismatchError) else None
    if where == MEMORY_SOURCE:
        return "memory"
    if where is not None and "peer" in where:
        return "peer"
    if isinstance(source, PeerSource):
        return "peer"
    if isinstance(source, MemorySource) or source is None:
        return "memory"
    return "persistent"


def report(
    daemon: DaemonClient,
    namespace: str | None,
    step: int | None,
    error: BaseException,
    source: Source | None,
) -> None:
    """Report ``error`` to the daemon if it is corruption (other errors are not)."""
    if not isinstance(error, IntegrityError) or namespace is None or step is None:
        return
    mismatch = error if isinstance(error, BlockMismatchError) else None
    daemon.report_corruption(
        namespace,
        step,
        CorruptionReport(
            file=mismatch.file if mismatch is not None else None,
            block=mismatch.block if mismatch is not None else None,
            tier=tier_of(error, source),
            detail=str(error)[:2000],
        ),
    )
