"""What the writer puts in DCP's save plans: each rank's word to the coordinator, and the
coordinator's decision for every rank. Both travel between ranks (pickled by DCP's collectives).
Each rank derives the save attempt id from the plan (:func:`next_attempt`)."""

from __future__ import annotations

import sys
import uuid
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from tierckpt_client.dcp._metadata_codec import metadata_text
from tierckpt_core.errors import DaemonUnavailableError, StepStateError
from tierckpt_core.protocol import CommitRequest


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
    id is derived from ``attempt_base`` by each rank (:func:`next_attempt`)."""

    attempt_base: str
    direct: bool  # write straight to the persistent tier (some rank cannot use its daemon)
    across: bool = False  # the ranks use several daemons: a commit across nodes

    def check_cached(self, where: str) -> None:
        """This rank staged into private memory (it lost its daemon): only with plan caching can
        the plan still send the save to the memory tier (the coordinator could not learn it)."""
        if not self.direct:
            raise DaemonUnavailableError(
                f"{where} cannot use its daemon, and the save plan (cached from an earlier save: "
                "enable_plan_caching) sends this save to the memory tier; retry the save, or save "
                "without plan caching"
            )


# Coordinator: the last layout each rank reported, per (namespace, world size). With plan
# caching, the plans of ranks whose plan did not change reach the coordinator without writer data.
_layouts: dict[tuple[str, int], list[LocalPlanData]] = {}


@dataclass(frozen=True)
class RankLayout:
    """Where the ranks' files go, as the coordinator reads it from their plans."""

    local: list[LocalPlanData]
    daemons: int  # how many daemons (nodes) the ranks use
    # Ranks on several daemons that are each other's peers: each keeps its files on its own
    # node, and the coordinator's daemon commits the step on all of them; rank i's node.
    rank_nodes: list[str | None] | None

    @property
    def unpeered(self) -> bool:
        """Several daemons that are not each other's peers: no commit across them."""
        return self.daemons > 1 and self.rank_nodes is None

    def why_unpeered(self, namespace: str, step: int) -> str:
        """Why the ranks' daemons cannot commit a save together: some rank cannot reach its
        daemon (one is down), two daemons have the same node name, or the daemons are not each
        other's peers (a configuration)."""
        down = [rank for rank, x in enumerate(self.local) if x.direct]
        if down:
            daemons = sorted({self.local[rank].daemon for rank in down})
            return (
                f"{namespace}/step {step}: rank(s) {', '.join(map(str, down[:8]))} cannot reach "
                f"their node's daemon ({', '.join(daemons[:4])}), and the trainers have no "
                "persistent tier (TIERCKPT_PERSIST_URL) to save to instead"
            )
        named: dict[str, set[str]] = {}
        for x in self.local:
            if x.node is not None:
                named.setdefault(x.node, set()).add(x.daemon)
        for node, holders in sorted(named.items()):
            if len(holders) > 1:
                return (
                    f"{namespace}/step {step}: the daemons {', '.join(sorted(holders)[:4])} all "
                    f"call themselves node {node}: each node's daemon needs its own "
                    "TIERCKPT_NODE_NAME (its own entry of TIERCKPT_PEERS)"
                )
        return (
            f"{namespace}/step {step}: the ranks use {self.daemons} daemons (nodes), which are "
            "not peers of each other (set TIERCKPT_PEERS, TIERCKPT_NODE_NAME and "
            "TIERCKPT_PEER_TOKEN on every node's daemon to commit across nodes)"
        )

    @property
    def direct(self) -> bool:
        """The save goes straight to the persistent tier."""
        return self.unpeered or any(x.direct for x in self.local)

    @classmethod
    def of(cls, namespace: str, step: int, plans: list[SavePlan]) -> RankLayout:
        known = _layouts.get((namespace, len(plans)))
        local: list[LocalPlanData] = []
        for rank, p in enumerate(plans):
            if isinstance(p.storage_data, LocalPlanData):
                local.append(p.storage_data)
            elif not p.usable and known is not None:  # plan caching: the rank's plan is unchanged
                local.append(known[rank])
            else:
                raise StepStateError(
                    f"{namespace}/step {step}: rank {rank}'s plan carries no writer data"
                )
        _layouts[(namespace, len(plans))] = local
        daemons = len({x.daemon for x in local})
        nodes = [x.node for x in local]
        across = daemons > 1 and None not in nodes and len(set(nodes)) == daemons
        return cls(local, daemons, nodes if across else None)


def dcp_save_world_size() -> int:
    """How many ranks the ``dcp.save`` calling this writer saves on.

    DCP tells a storage writer its rank but not the size of its group, and a ``no_dist=True``
    save, or one on a group of one rank, is one process even in a job of many. So read it from
    the saver's own frame (as the reader does for ``no_dist`` loads); without that frame, assume
    the whole job."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_save_state_dict" and code.co_filename.endswith("state_dict_saver.py"):
            get_world_size = getattr(frame.f_locals.get("distW"), "get_world_size", None)
            if callable(get_world_size):
                return int(get_world_size())
            break
        frame = frame.f_back  # type: ignore[assignment]
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


WAITS = ("committed", "replicated")  # TieredStorageWriter(wait=...)


def check_options(on_unavailable: str, wait: str, replicated_timeout_s: float) -> None:
    """A writer's save options, refused with a ``ValueError`` that names the bad one."""
    if on_unavailable not in ("persist", "raise"):
        raise ValueError(f"on_unavailable must be 'persist' or 'raise', got {on_unavailable!r}")
    if wait not in WAITS:
        raise ValueError(f"wait must be one of {WAITS}, got {wait!r}")
    if replicated_timeout_s <= 0:
        raise ValueError(f"replicated_timeout_s must be > 0, got {replicated_timeout_s}")


def refuse_rank_local(namespace: str, step: int) -> None:
    """``dcp.save(..., use_collectives=False)`` on several ranks: each rank would commit the step
    alone, each commit replacing the last: a step holding one rank's part, reported as saved.
    There is no rank-local commit."""
    if (world := dcp_save_world_size()) > 1:
        raise StepStateError(
            f"{namespace}/step {step}: dcp.save(..., use_collectives=False) is not supported "
            f"by TieredStorageWriter with {world} ranks: a step is committed once, with every "
            "rank's part; save with use_collectives=True (the default), or give each rank its "
            "own namespace and save without a process group (no_dist=True)"
        )


def commit_request(
    metadata: Metadata,
    results: list[list[WriteResult]],
    rank_nodes: list[str | None] | None,
    persist: bool | None,
    overwrite: bool,
) -> CommitRequest:
    """The coordinator's commit of every rank's files, with DCP's ``metadata`` (its storage data
    filled in here); ``rank_nodes``: in a commit across nodes, the node of each rank."""
    storage = {}
    files: set[str] = set()
    for rank_results in results:
        for r in rank_results:
            storage[r.index] = r.storage_data
            files.add(r.storage_data.file)
    metadata.storage_data = storage
    nodes = None
    if rank_nodes is not None:  # rank i's files are on the daemon rank i used
        nodes = {
            r.storage_data.file: rank_nodes[rank]
            for rank, rank_results in enumerate(results)
            for r in rank_results
        }
    return CommitRequest(
        files=sorted(files),
        metadata=metadata_text(metadata),
        world_size=len(results),
        persist=persist,
        nodes=nodes,
        overwrite=overwrite,
    )


# Save attempt ids. Every rank of one save must seal under the same attempt id, and two saves of
# one step must not share one (the daemon would mix their files). The coordinator cannot hand a
# fresh id to the ranks through the plan: with DefaultSavePlanner(enable_plan_caching=True), DCP
# gives every rank its cached plan from an earlier save, storage data included. So the plan carries
# a base that stays the same for as long as the coordinator's process lives, and every rank derives
# the attempt from it and the number of saves of this step it has written with that base: the
# same on every rank, whichever plan (fresh or cached) it got.
_base: str | None = None
_saves: dict[tuple[str, str, int], int] = {}


def attempt_base() -> str:
    """The coordinator process's attempt base (random, made once per process)."""
    global _base
    if _base is None:
        _base = uuid.uuid4().hex[:16]
    return _base


def next_attempt(base: str, namespace: str, step: int) -> str:
    """The attempt id of this rank's next save of ``namespace``/``step`` under ``base``."""
    key = (base, namespace, step)
    _saves[key] = _saves.get(key, 0) + 1
    return f"{base}.{_saves[key]}"
