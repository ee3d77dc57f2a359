"""Where a reader's step comes from, in order: this node's memory, a peer that holds a replica,
the persistent tier; and which steps "latest" may pick from across those tiers.

The sources are small Protocols, so this module knows neither the uploader nor the peers (they
fill the memory tier through :func:`tierckpt_daemon.tier.hydration.fill_step`); what only the ring
knows of a step spanning nodes (its metadata's holders, its share table, its lost shares) is
asked of a ``RingSource`` (:mod:`tierckpt_daemon.peers.spanning`). The daemon's wiring
(:mod:`tierckpt_daemon.node`) hands them in.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from tierckpt_core.errors import (
    CheckpointFormatError,
    NamespaceNotFoundError,
    NotFoundError,
    PeerUnavailableError,
    PersistentTierError,
    StepNotFoundError,
)
from tierckpt_core.manifest import StepManifest
from tierckpt_core.protocol import (
    StepCandidate,
    StepInfo,
    StepState,
    validate_namespace,
    validate_step,
)
from tierckpt_daemon.locks import KeyedLocks
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

METADATA_CACHE_STEPS = 4  # steps whose metadata, fetched from its holders, is kept in memory


def _durable_else(
    failed: PeerUnavailableError | None,
    hydrate: Callable[..., StepInfo],
    namespace: str,
    step: int,
    files: set[str] | None,
    owner: str | None,
) -> StepInfo:
    """The persistent tier's copy; where it has none and the peers that hold the step failed
    to send it (``failed``), their failure is the answer, not "not found" (a reader takes that
    for a step that is gone, and restores an older one)."""
    try:
        return hydrate(namespace, step, files, owner=owner)
    except NotFoundError:
        if failed is None:
            raise
        raise failed from None


def _undecided(namespace: str, partial: list[int], silent: list[str]) -> PeerUnavailableError:
    """No whole step found, where peers that did not answer may hold one (or the rest of one
    held here in part): not "nothing to restore", which a trainer takes for a fresh start."""
    steps = ", ".join(map(str, partial[:4]))
    if not silent:  # every peer answered: those shares went with their nodes and replicas
        return PeerUnavailableError(
            f"namespace {namespace}: step(s) {steps} held in part, their other shares on no "
            "node (lost with their nodes and their replicas), and no whole step: not starting "
            f"from scratch on a guess; `tierckpt rm {namespace} STEP` where a part is held lets "
            "the job start afresh"
        )
    held = f"step(s) {steps} held in part" if partial else "no committed step found"
    return PeerUnavailableError(
        f"namespace {namespace}: {held}, and {', '.join(silent[:8])} did not answer: which step "
        "is the newest cannot be told now, so this is not a fresh start; retry once the peers "
        "answer (a node gone for good leaves TIERCKPT_PEERS)"
    )


class PeerSource(Protocol):
    """Peers' copies; ``owner``: only that identity's steps count (None: anyone's)."""

    def peer_steps(
        self,
        namespace: str,
        *,
        owner: str | None = None,
        silent: list[str] | None = None,
        near_silent: list[str] | None = None,
    ) -> dict[int, list[str]]:
        """Which peers hold which committed steps (unreachable peers skipped, never waited on;
        each added to ``silent``, with why, and a ring neighbour to ``near_silent`` too)."""
        ...

    def hydrate(
        self,
        namespace: str,
        step: int,
        files: set[str] | None = None,
        *,
        owner: str | None = None,
    ) -> StepInfo:
        """Copy a step (of a step spanning nodes: ``files``, default this node's share) from
        peers into memory, verified; NotFoundError if no peer holds it, CheckpointFormatError if
        every replica found was corrupt."""
        ...


class RingSource(Protocol):
    """What only the ring knows of a step spanning nodes (:mod:`tierckpt_daemon.peers.spanning`)."""

    def metadata(self, manifest: StepManifest) -> str:
        """The DCP metadata of a step whose record here leaves it to its holders."""
        ...

    def missing(self, rec: StepRecord, files: list[str] | None) -> set[str]:
        """Of a step held here, the files still to bring for ``files`` (None: this node's own
        share); StepNotFoundError names files the step does not have."""
        ...

    def lost(self, namespace: str, step: int, owner: str | None, known: list[str]) -> bool:
        """Whether the step spans nodes and some of its files are on no reachable node."""
        ...


LISTING_WAIT_S = 5.0
"""How long a load of "latest" waits for the persistent tier's listing when memory or peers hold
steps of the namespace (a tier that hangs must not hold a restore from memory up for its whole
timeout); with nothing elsewhere it waits as long as the tier's own timeouts allow."""


class DurableSource(Protocol):
    def durable_steps(self, namespace: str, *, wait_s: float | None = None) -> list[int]: ...

    def newest_durable_steps(
        self, namespace: str, below: int | None, *, wait_s: float | None = None
    ) -> tuple[list[int], bool]:
        """The newest few durable steps (older than ``below``), newest first, and whether
        older ones may be there; PersistentTierError if the tier does not answer within
        ``wait_s`` (None: its own timeouts)."""
        ...

    def manifest(self, namespace: str, step: int) -> StepManifest:
        """The manifest of a durable step (NotFoundError if it is not durable)."""
        ...

    def hydrate(
        self, namespace: str, step: int, files: set[str] | None = None, *, owner: str | None = None
    ) -> StepInfo:
        """Bring a durable step (of a step spanning nodes: ``files``, default this node's share)
        into memory, verified; NamespaceOwnerError if it is not ``owner``'s."""
        ...


class Restorer:
    def __init__(
        self,
        service: TierService,
        *,
        peers: PeerSource | None = None,
        durable: DurableSource | None = None,
        ring: RingSource | None = None,
    ) -> None:
        self.service = service
        self.peers = peers
        self.durable = durable
        self.ring = ring
        self._locks = KeyedLocks()  # one hydration per step at a time

    def metadata(self, namespace: str, step: int, *, owner: str | None = None) -> str:
        """The DCP metadata of a committed step held here. A step spanning nodes keeps it on its
        decider and the nodes after it (RingRecord): on any other node it comes from the ring
        (:meth:`RingSource.metadata`)."""
        manifest = self.service.manifest(namespace, step, owner=owner)
        if not manifest.metadata_elsewhere:
            return manifest.metadata
        if self.ring is None:
            raise StepNotFoundError(
                f"{namespace}/step {step}: its DCP metadata is kept by its holders, and this "
                "daemon has no peers and no persistent tier"
            )
        return self.ring.metadata(manifest)

    def candidates(
        self,
        namespace: str,
        *,
        owner: str | None = None,
        complete: bool = False,
        silent: list[str] | None = None,
    ) -> list[StepCandidate]:
        """Steps ``latest`` may pick, newest first: committed in memory, held by a peer, or
        durable (every durable step: the persistent tier's whole listing, for ``tierckpt ls``);
        of peers' copies, only ``owner``'s (None: anyone's). Unreachable peers are skipped
        (with a warning), never waited for long. A persistent tier that does not answer leaves
        its steps out, unless ``complete``: then its PersistentTierError is raised (a listing
        must not hide durable steps without saying so). The peers that did not answer are
        added to ``silent``."""
        return self._candidates(
            namespace, owner, None, whole=True, complete=complete, silent=silent
        )[0]

    def newest_candidates(
        self, namespace: str, *, owner: str | None = None, below: int | None = None
    ) -> tuple[list[StepCandidate], int | None]:
        """:meth:`candidates` (older than ``below``) for a load of "latest", with only the newest
        durable steps of the persistent tier looked up (its step directories listed, then their
        markers newest first: not every object of the namespace); where it may hold older
        durable steps than those, the candidates stop at the oldest of them, which is returned
        (the next call's ``below``: the walk stays newest first), else None."""
        return self._candidates(namespace, owner, below, whole=False)

    def _candidates(
        self,
        namespace: str,
        owner: str | None,
        below: int | None,
        *,
        whole: bool,
        complete: bool = False,
        silent: list[str] | None = None,
    ) -> tuple[list[StepCandidate], int | None]:
        validate_namespace(namespace)
        silent = [] if silent is None else silent
        near_silent: list[str] = []  # ring neighbours, which may hold this node's replicas
        on_peers = (
            self.peers.peer_steps(namespace, owner=owner, silent=silent, near_silent=near_silent)
            if self.peers is not None
            else {}
        )
        in_memory = {r.step: r.state for r in self.service.records(namespace, owner=owner)}
        durable: set[int] = set()
        floor: int | None = None  # the oldest durable step looked up, where older ones may be
        tier_error: PersistentTierError | None = None
        # With steps in memory, a persistent tier that hangs holds "latest" up a few seconds at
        # most, not its own timeout (60 s by default): it may hold a newer step only seldom.
        # A listing that must be complete (``tierckpt ls``) waits for the tier's own timeouts: a
        # large namespace's whole listing may take longer than LISTING_WAIT_S.
        wait_s = LISTING_WAIT_S if (in_memory or on_peers) and not complete else None
        if self.durable is not None:
            try:
                if whole:
                    durable = set(self.durable.durable_steps(namespace, wait_s=wait_s))
                else:
                    newest, more = self.durable.newest_durable_steps(
                        namespace, below, wait_s=wait_s
                    )
                    durable = set(newest)
                    floor = newest[-1] if more else None
            except PersistentTierError as e:
                # A broken persistent tier must not take the memory tier down with it.
                logger.warning("%s: listing the persistent tier failed: %s", namespace, e)
                if complete:
                    raise
                tier_error = e
        durable |= {s for s, state in in_memory.items() if state == StepState.DURABLE}
        steps = sorted(set(in_memory) | durable | set(on_peers), reverse=True)
        if below is not None:
            steps = [s for s in steps if s < below]
        if floor is not None:  # older ones come with the next call, in order
            steps = [s for s in steps if s >= floor]
        # "latest" must be whole: skip steps spanning nodes whose lost shares are nowhere.
        partial: list[int] = []
        while (
            steps
            and steps[0] not in durable
            and self.ring is not None
            and self.ring.lost(namespace, steps[0], owner, on_peers.get(steps[0], []))
        ):
            partial.append(steps.pop(0))
        if not steps:
            if tier_error is not None:
                raise tier_error
            # A load of "latest" (not a listing, which says who did not answer): where the
            # newest step cannot be told, that is not "nothing to restore", which a trainer
            # takes for a first start. A peer farther on the ring (asked when no neighbour
            # knows the namespace: every first start) blocks nothing.
            if not whole and below is None and (partial or near_silent):
                raise _undecided(namespace, partial, silent)
            where = " or the persistent tier" if self.durable else ""
            where += ", nor do its peers hold one" if self.peers else ""
            if below is not None:
                raise StepNotFoundError(
                    f"namespace {namespace} has no committed step older than step {below} in "
                    f"memory{where}"
                )
            raise NamespaceNotFoundError(
                f"namespace {namespace} has no committed step in memory{where}"
            )
        cands = [
            StepCandidate(
                step=s, in_memory=s in in_memory, durable=s in durable, peers=on_peers.get(s, [])
            )
            for s in steps
        ]
        return cands, floor

    def hydrate(
        self,
        namespace: str,
        step: int,
        files: list[str] | None = None,
        *,
        owner: str | None = None,
    ) -> StepInfo:
        """Make a step available in memory (from peers and the persistent tier, ``owner``'s
        only): already here, else a verified copy from a peer that
        holds a replica, else from the persistent tier. Of a step spanning nodes, a node holds
        the files its ranks wrote; ``files`` names others this node's readers need, which come
        from the peers that hold them. Concurrent calls for one step (every rank of the node
        asks) wait for the first."""
        validate_namespace(namespace)
        validate_step(step)
        with self._locks.held((namespace, step)):
            try:
                rec = self.service.record(namespace, step, owner=owner)
            except NotFoundError as e:
                missing: NotFoundError = e
            else:
                need = self._missing(rec, files)
                if not need:
                    return rec.info()
                return self._fetch(namespace, step, need, owner)
            wanted = set(files) if files else None
            failed: PeerUnavailableError | None = None
            if self.peers is not None:
                try:
                    return self.peers.hydrate(namespace, step, wanted, owner=owner)
                except NotFoundError as e:
                    missing = e
                except (CheckpointFormatError, PeerUnavailableError) as e:
                    # Every replica failed verification, or its holders failed to send it.
                    if self.durable is None:
                        raise
                    failed = e if isinstance(e, PeerUnavailableError) else None
                    logger.warning(
                        "%s/step %d: no good replica on the peers (%s); trying the persistent tier",
                        namespace,
                        step,
                        e,
                    )
            if self.durable is None:
                raise missing
            return _durable_else(failed, self.durable.hydrate, namespace, step, wanted, owner)

    def _missing(self, rec: StepRecord, files: list[str] | None) -> set[str]:
        if self.ring is not None:
            return self.ring.missing(rec, files)
        need = set(files or ()) - set(rec.files)  # no peers, no persistent tier: no ring to ask
        if need:
            raise StepNotFoundError(
                f"{rec.namespace}/step {rec.step} has no file {', '.join(sorted(need)[:8])}"
            )
        return need

    def _fetch(self, namespace: str, step: int, need: set[str], owner: str | None) -> StepInfo:
        """Files of a step spanning nodes that other nodes hold: from the peers that hold them,
        else from the persistent tier."""
        where = f"{namespace}/step {step}: {', '.join(sorted(need)[:8])}"
        if self.peers is not None:
            try:
                return self.peers.hydrate(namespace, step, need, owner=owner)
            except (NotFoundError, CheckpointFormatError, PeerUnavailableError) as e:
                if self.durable is None:
                    raise
                logger.warning("%s: not on the peers (%s); trying the persistent tier", where, e)
                if isinstance(e, PeerUnavailableError):
                    return _durable_else(e, self.durable.hydrate, namespace, step, need, owner)
        if self.durable is None:
            raise StepNotFoundError(
                f"{where} are held by other nodes, and this daemon has no peers (TIERCKPT_PEERS) "
                "and no persistent tier"
            )
        return self.durable.hydrate(namespace, step, need, owner=owner)
