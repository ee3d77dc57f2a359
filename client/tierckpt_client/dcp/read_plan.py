"""The read plan: which step a load reads, and from where, chosen once before ``read_metadata``
returns; ``read_data`` then reads from that source and nowhere else (but for the two ways back
below).

From the daemon's candidates (newest first: each step in this node's memory, held by peers, or
durable in the persistent tier), the :class:`Planner` picks a :class:`ReadPlan`:

- in this node's memory: ``sources.memory`` (pinned files);
- held by peers only: ``sources.peers``, straight into the tensors through connections the daemon
  hands over, if it offers them and the reader may (``restore_direct``);
- durable only: ``sources.persistent`` streamed straight into the tensors, if this process can
  read the tier (``TIERCKPT_PERSIST_URL``, ``restore_direct``);
- else hydrate-then-memory: the daemon brings the step into its memory first (a step it cannot
  bring, corrupt or incomplete, is skipped for an older one, with a warning);
- no daemon at all (or a step too large for its memory): ``sources.persistent`` read by this
  process alone, for the rest of the load.

The two ways back: a read from the peers that fails on every peer is read again the daemon's way
(:meth:`ReadPlan.instead`), and a load of "latest" whose step is found corrupt while it is read
plans again below it, on every rank together (``reader._read_latest``, ``_fallback``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp._fallback import Agreement, decide
from tierckpt_client.dcp._metadata_codec import decoded
from tierckpt_client.dcp.sources import MemorySource, PeerSource, PersistentSource, Source
from tierckpt_core.errors import (
    CapacityExceededError,
    CheckpointFormatError,
    DaemonUnavailableError,
    NotFoundError,
    PersistentTierError,
    StepNotFoundError,
    TierCkptError,
)
from tierckpt_core.manifest import RECORD_FILE
from tierckpt_core.protocol import CorruptionReport, ReadResponse, StepCandidate

# The reader's logger: where users (and their log filters) find what a load read from.
logger = logging.getLogger("tierckpt_client.dcp.reader")


@dataclass(frozen=True)
class ReadPlan:
    """Step ``step``, read from ``source``; ``fallback``: where to read it again when reading
    from the peers failed on every peer (the daemon's own way)."""

    step: int
    source: Source
    fallback: MemorySource | None = None

    def instead(self) -> MemorySource | None:
        """Where to read again after the read from the peers failed; None: the error stands."""
        if isinstance(self.source, MemorySource) and not self.source.read_peers:
            return None  # it read nothing from the peers
        return self.fallback


class Planner:
    """Picks each load's plan. One per reader; :meth:`reset` at the start of each load."""

    def __init__(self, daemon: DaemonClient, config: ClientConfig) -> None:
        self.daemon = daemon
        self.config = config
        self.memory = MemorySource(daemon, config, peers=True)
        self._streamed: PersistentSource | None = None  # kept: its store and manifests
        self.direct: PersistentSource | None = None  # no daemon: this load reads the tier itself

    def reset(self) -> None:
        """Each load starts from the daemon (a reader reused after a load without one)."""
        self.direct = None

    def in_memory(self, step: int) -> ReadPlan:
        return ReadPlan(step, self.memory, self.memory.without_peers())

    # -- which step ---------------------------------------------------------------------------
    def latest(self, namespace: str, how: Agreement, below: int | None = None) -> ReadPlan | int:
        """The newest good step (older than ``below``), the same on every rank: rank 0's plan
        for it (on rank 0), else the step, for :meth:`plan` to find this rank's source."""
        chosen: list[ReadPlan] = []

        def find() -> int:
            plan = self._newest(namespace, below)
            chosen.append(plan)
            return plan.step

        what = "the latest step" if below is None else f"a step older than {below}"
        step = decide(how, find, what)
        return chosen[0] if chosen and chosen[0].step == step else step

    def _newest(self, namespace: str, below: int | None) -> ReadPlan:
        """The newest step in memory or durable that is complete and verifies (and older than
        ``below``); older ones are tried when a newer one is corrupt or incomplete, with a
        warning naming the step."""
        if self.direct is None:
            try:
                return self._newest_through_daemon(namespace, below)
            except (DaemonUnavailableError, CapacityExceededError) as e:
                self._go_direct(e)
        assert self.direct is not None
        return ReadPlan(self.direct.newest_good_step(namespace, below), self.direct)

    def _unreadable(self, namespace: str, step: int, read: ReadResponse) -> str | None:
        """Why the metadata the daemon sent with the candidates cannot be decoded (its commit
        record in this node's memory was damaged), or None. Such a step is skipped for an older
        one, as a corrupt one is, and the daemon is told; decoded once (the load's own decoding
        of the same text finds it decoded)."""
        if read.metadata is None:  # (kept by other nodes: the load fetches and checks it)
            return None
        try:
            decoded(read.metadata, where=f"{namespace}/step {step}")
        except CheckpointFormatError as e:
            logger.warning("%s: skipping step %d for an older one: %s", namespace, step, e)
            self.daemon.report_corruption(  # (the commit record: the daemon checks it too)
                namespace,
                step,
                CorruptionReport(file=RECORD_FILE, tier="memory", detail=str(e)[:2000]),
            )
            return str(e)
        return None

    def _newest_through_daemon(self, namespace: str, below: int | None) -> ReadPlan:
        skipped: list[str] = []
        ask = below
        while True:  # the persistent tier's durable steps come a few at a time, newest first
            try:
                found = self.daemon.candidates_read(namespace, ask)
            except StepNotFoundError:
                if ask == below:
                    raise
                break  # none older than those skipped
            for cand in found.candidates:
                if ask is not None and cand.step >= ask:
                    continue  # (a daemon older than ``below`` answers every candidate)
                if cand.in_memory:
                    if found.read is not None and cand is found.candidates[0]:
                        # Its metadata came with the candidates: the load asks only for the pin.
                        unreadable = self._unreadable(namespace, cand.step, found.read)
                        if unreadable is not None:
                            skipped.append(f"step {cand.step}: {unreadable}")
                            continue
                        self.memory.adopt(namespace, cand.step, found.read)
                    return self.in_memory(cand.step)
                try:
                    plan = self._elsewhere(namespace, cand)
                    if plan is not None:
                        return plan
                    self.daemon.hydrate(namespace, cand.step)
                except (CheckpointFormatError, NotFoundError) as e:
                    logger.warning(
                        "%s: skipping step %d for an older one: %s", namespace, cand.step, e
                    )
                    skipped.append(f"step {cand.step}: {e}")
                    continue
                return self.in_memory(cand.step)
            if found.next_below is None or (ask is not None and found.next_below >= ask):
                break
            ask = found.next_below
        older_than = f" older than step {below}" if below is not None else ""
        raise StepNotFoundError(
            f"namespace {namespace}: no step{older_than} could be restored ({'; '.join(skipped)})"
        )

    # -- from where ---------------------------------------------------------------------------
    def plan(self, namespace: str, chosen: ReadPlan | int) -> tuple[ReadPlan, str]:
        """This rank's plan for the step chosen (an explicit step, or the one "latest" resolved
        to), and the step's metadata. This node's memory first; a step not there is read
        straight from where it is (:meth:`_elsewhere`), else brought into memory by the daemon."""
        if isinstance(chosen, ReadPlan) and chosen.source is not self.memory:
            return chosen, chosen.source.metadata(namespace, chosen.step)
        step = chosen.step if isinstance(chosen, ReadPlan) else chosen
        if self.direct is None:
            try:
                return self._through_daemon(namespace, step)
            except (DaemonUnavailableError, CapacityExceededError) as e:
                self._go_direct(e)
        assert self.direct is not None
        return ReadPlan(step, self.direct), self.direct.metadata(namespace, step)

    def _through_daemon(self, namespace: str, step: int) -> tuple[ReadPlan, str]:
        try:
            return self.in_memory(step), self.memory.metadata(namespace, step)
        except NotFoundError:
            # (``below``: the persistent tier's newest durable step below it is the step itself,
            # if it is durable; its whole listing is not needed)
            try:
                found = self.daemon.candidates_read(namespace, step + 1).candidates
            except StepNotFoundError:  # none up to it: the daemon's hydrate says what is missing
                found = []
            cand = next((c for c in found if c.step == step), None)
            plan = self._elsewhere(namespace, cand) if cand is not None else None
            if plan is not None:
                return plan, plan.source.metadata(namespace, step)
            self.daemon.hydrate(namespace, step)
            return self.in_memory(step), self.memory.metadata(namespace, step)

    def _elsewhere(self, namespace: str, cand: StepCandidate) -> ReadPlan | None:
        """A step not in this node's memory, read straight into the destination tensors
        (verified block by block) from where it is: the peers that hold it (through connections
        the daemon hands over), else, durable, the persistent tier if this process can reach it.
        The daemon brings it into memory afterwards. None when it cannot be read from here (the
        daemon then brings the step into memory first)."""
        if cand.in_memory:
            return None
        if cand.peers:  # nearer than the persistent tier
            if not self.config.reads_peers_direct():
                return None
            peers = PeerSource.offered(self.daemon, self.config, namespace, cand.step)
            if peers is None:
                return None
            logger.info(
                "%s/step %d is not in this node's memory: reading it straight from the peers "
                "that hold it (%s), verified; the daemon brings it into memory afterwards",
                namespace,
                cand.step,
                ", ".join(sorted(peers.sources.holders)),
            )
            return ReadPlan(cand.step, peers, self.memory.without_peers())
        if not cand.durable or not self.config.reads_direct():
            return None
        step = cand.step
        url = self.config.persist_url
        assert url is not None
        source = self._streamed
        if source is None:
            source = self._streamed = PersistentSource(url, self.config, streamed=True)
        try:
            source.metadata(namespace, step)
        except (PersistentTierError, NotFoundError) as e:
            # Unreachable, no credentials here, or not what the daemon's tier holds: the daemon
            # reads its own tier.
            logger.warning(
                "%s/step %d: cannot read the persistent tier %s from this process (%s); the "
                "daemon brings the step into memory first",
                namespace,
                step,
                url,
                e,
            )
            return None
        logger.info(
            "%s/step %d is in no node's memory: reading it straight from %s, verified; the "
            "daemon brings it into memory afterwards",
            namespace,
            step,
            url,
        )
        return ReadPlan(step, source)

    def _go_direct(self, cause: TierCkptError) -> None:
        """No daemon, or a step too large for its memory tier (saved straight to the persistent
        tier by a writer's ``on_unavailable="persist"``): read the persistent tier ourselves, if
        this process knows where it is."""
        url = self.config.persist_url
        if not url:
            raise cause
        logger.warning(
            "%s; restoring straight from the persistent tier %s (TIERCKPT_PERSIST_URL)", cause, url
        )
        self.direct = PersistentSource(url, self.config, streamed=False)
