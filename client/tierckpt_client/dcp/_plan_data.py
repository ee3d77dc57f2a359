"""What the writer puts in DCP's save plans: each rank's word to the coordinator, and the
coordinator's decision for every rank. Both travel between ranks (pickled by DCP's collectives)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LocalPlanData:
    """What each rank tells the coordinator."""

    direct: bool  # this rank cannot use its daemon
    daemon: str  # which daemon (host and socket) holds this rank's files
    node: str | None = None  # that daemon's node name among its peers (None: it has no peers)


@dataclass(frozen=True)
class PlanData:
    """What the coordinator hands every rank in its plan. With plan caching, DCP hands a rank its
    cached plan from an earlier save instead, so nothing here may belong to one save: the attempt
    id is derived from ``attempt_base`` by each rank (``_ids.next_attempt``)."""

    attempt_base: str
    direct: bool  # write straight to the persistent tier (some rank cannot use its daemon)
    across: bool = False  # the ranks use several daemons: a commit across nodes
