"""One daemon's parts, wired together: the memory tier's service, the uploader and the replicator
(commit listeners of the service), the restore order across tiers, and the status and metrics
that report on all of them.

Nothing here holds state of its own; :func:`build_node` is the one place that knows which parts a
configuration turns on and builds each once (one peer client, one ring, one copier, handed to every
part that uses them), so no part needs a back-pointer to another; :class:`Node` starts and closes
them all.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from tierckpt_core.errors import StepStateError
from tierckpt_core.protocol import API_VERSION, CommitRequest, StatusResponse, StepInfo
from tierckpt_daemon import __version__
from tierckpt_daemon.config import DaemonSettings, parse_size
from tierckpt_daemon.failures import ThreadFailures
from tierckpt_daemon.metrics import Snapshot
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.cluster import ClusterLister
from tierckpt_daemon.peers.commit import GlobalCommitter
from tierckpt_daemon.peers.copier import Copier
from tierckpt_daemon.peers.fetch import PeerFetcher
from tierckpt_daemon.peers.handoff import HandoffServer
from tierckpt_daemon.peers.membership import Members, Membership, Ring
from tierckpt_daemon.peers.pacing import TokenBucket
from tierckpt_daemon.peers.replica_wait import ReplicaWait
from tierckpt_daemon.peers.replication import Replicator
from tierckpt_daemon.peers.spanning import SpanningReads
from tierckpt_daemon.tier.arena import Arena
from tierckpt_daemon.tier.pending import PENDING_FILE, clear_pending, write_pending
from tierckpt_daemon.tier.persist import Persister
from tierckpt_daemon.tier.restore import Restorer
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)


@dataclass
class Node:
    """The daemon's parts, and their life cycle: :meth:`start` starts the background workers
    (and the handoff server, when one was bound), :meth:`close` stops and closes everything
    this node holds, in the reverse order (as uvicorn's ``Server`` and swift's ``Daemon`` own
    what they built)."""

    service: TierService
    restorer: Restorer
    persister: Persister | None = None
    replicator: Replicator | None = None
    committer: GlobalCommitter | None = None
    cluster: ClusterLister | None = None  # with peers: asks them what they hold
    # With peers on plain TCP, once serving: hands trainers connections to peers for restores.
    handoff: HandoffServer | None = None
    # With peers: waits until every share of a step has its replicas (wait="replicated" saves).
    replica_wait: ReplicaWait | None = None
    # With peers: the one peer client, the ring, the copy path and the restore's reads.
    client: PeerClient | None = None
    ring: Ring | None = None
    copier: Copier | None = None
    fetcher: PeerFetcher | None = None
    metrics_namespace_labels: str = "hashed"  # TIERCKPT_METRICS_NAMESPACE_LABELS
    drain_timeout_s: float = 60.0  # TIERCKPT_DRAIN_TIMEOUT_S: queued uploads at close
    # Background threads that died; the threading.excepthook while serving (server.serve).
    failures: ThreadFailures = field(init=False)
    _closed: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.service.metrics.attach(self.snapshot, self.metrics_namespace_labels)
        self.failures = ThreadFailures(self.service.metrics.thread_failures)

    @property
    def spanning(self) -> SpanningReads:
        """What only the ring knows of a step spanning nodes (its record for a reader here,
        ranges of a file another node holds)."""
        ring = self.restorer.ring
        assert isinstance(ring, SpanningReads)  # build_node's
        return ring

    def start(self) -> None:
        """Start the background workers: resumed uploads and replications, the in-doubt
        resolver, the handoff server."""
        for part in (self.persister, self.replicator, self.committer, self.handoff):
            if part is not None:
                part.start()
        # UPLOADS_PENDING of a daemon before: gone once nothing waits (else it stays until this
        # daemon's close rewrites or removes it, so a crash meanwhile still keeps the tier).
        if self.persister is not None and not self.service.pending_uploads():
            clear_pending(self.service.arena.root)

    def close(self) -> None:
        """Stop every worker and close every part (once; later calls do nothing). Pending
        pushes resume after the next start (``replication_pending`` in the manifest); queued
        uploads get ``drain_timeout_s``, and what is left resumes after the next start."""
        if self._closed:
            return
        self._closed = True
        if self.committer is not None:
            self.committer.stop()
        if self.replicator is not None:
            self.replicator.stop()
        if self.persister is not None:
            if queued := self.persister.queued():  # a stop that waits says why and how long
                st = self.persister.status()
                logger.warning(
                    "stopping: waiting up to %.0fs (TIERCKPT_DRAIN_TIMEOUT_S) for %d queued "
                    "upload(s) to %s%s",
                    self.drain_timeout_s,
                    queued,
                    st.url,
                    f"; the tier is unhealthy: {st.last_error}"
                    if st.healthy is False and st.last_error
                    else "",
                )
            root = self.service.arena.root
            pending = [f"{r.namespace}/step {r.step}" for r in self.service.pending_uploads()]
            if pending:  # before the drain: a SIGKILL during it (Slurm's KillWait) leaves it too
                write_pending(root, pending)
            if self.persister.drain(self.drain_timeout_s):
                clear_pending(root)
            else:
                pending = [f"{r.namespace}/step {r.step}" for r in self.service.pending_uploads()]
                logger.warning(
                    "uploads not finished after %.0fs (%s); they resume when a daemon starts on "
                    "this tier directory (%s says so: keep the directory)",
                    self.drain_timeout_s,
                    ", ".join(pending) or "queued",
                    PENDING_FILE,
                )
                write_pending(root, pending)
            self.persister.stop()
        for closer in (self.handoff, self.fetcher, self.copier, self.client):
            if closer is not None:
                closer.close()

    def commit(self, namespace: str, step: int, attempt: str, req: CommitRequest) -> StepInfo:
        """A trainer's commit: on this daemon alone, or, when the ranks used several daemons,
        across all of them (:mod:`tierckpt_daemon.peers.commit`)."""
        nodes = set((req.nodes or {}).values())
        if self.committer is None or not nodes or nodes == {self.committer.node}:
            if nodes and self.committer is None:
                raise StepStateError(
                    f"{namespace}/step {step}: the ranks used {len(nodes)} daemons "
                    f"({', '.join(sorted(nodes))}), but this daemon has no peers to commit "
                    "across nodes with: set TIERCKPT_PEERS, TIERCKPT_NODE_NAME and "
                    "TIERCKPT_PEER_TOKEN on every node's daemon"
                )
            return self.service.commit(namespace, step, attempt, req)
        # The service times a commit on one node; one across nodes is timed here, as a whole
        # (prepare, decide, the participants told): tierckpt_commit_seconds had none of them.
        with self.service.metrics.commit_seconds.time():
            return self.committer.commit(namespace, step, attempt, req)

    def wait_replicated(
        self, namespace: str, step: int, timeout_s: float, *, owner: str | None = None
    ) -> StepInfo:
        """The step, once every share of it has its replicas (:mod:`.peers.replica_wait`)."""
        if self.replica_wait is None:
            raise StepStateError(
                f"{namespace}/step {step}: a save that waits for its replicas needs peers, and "
                "this daemon has none (TIERCKPT_PEERS)"
            )
        return self.replica_wait.wait(namespace, step, timeout_s, owner=owner)

    def snapshot(self) -> Snapshot:
        """The state gauges of /metrics."""
        svc = self.service
        persistent = self.persister.status() if self.persister is not None else None
        usage = svc.usage()
        return Snapshot(
            capacity_bytes=usage.capacity_bytes,
            bytes_by_state=usage.bytes_by_state,
            steps_by_state=usage.steps_by_state,
            upload_queue=persistent.queued_steps if persistent else 0,
            persistent_healthy=persistent.healthy if persistent else None,
            replication_queue=self.replicator.queued() if self.replicator is not None else 0,
            ages=svc.freshness.ages(),
            due_steps=svc.freshness.due_steps(),
        )

    def status(self, shm_dir: str) -> StatusResponse:
        persistent = self.persister.status() if self.persister is not None else None
        replication = self.replicator.status() if self.replicator is not None else None
        usage = self.service.usage()
        return StatusResponse(
            version=__version__,
            api_version=API_VERSION,
            shm_dir=shm_dir,
            capacity_bytes=usage.capacity_bytes,
            used_bytes=usage.used_bytes,
            pool_bytes=usage.pool_bytes,
            pool_files=usage.pool_files,
            leased_bytes=usage.leased_bytes,
            keep_last=self.service.keep_last,
            namespaces=usage.namespaces,
            persistent=persistent,
            replication=replication,
            failed_threads=self.failures.failed(),
        )


def build_node(settings: DaemonSettings) -> Node:
    """The daemon's parts for ``settings``, with the index rebuilt from the tier directory. Each
    part is built once and handed to those that use it; :meth:`Node.start` starts them and
    :meth:`Node.close` stops and closes every one."""
    arena = Arena(settings.shm_dir, settings.capacity_bytes, prefault=settings.prefault)
    service = TierService(
        arena,
        keep_last=settings.keep_last,
        lease_ttl_s=settings.lease_ttl_s,
        persistent=bool(settings.persist_url),
        persist_every=settings.persist_every,
        replicas=settings.replicas if settings.peers else 0,
        node=settings.node_name if settings.peers else None,
    )
    service.rebuild()
    persister = None
    if settings.persist_url:
        from tierckpt_core.objectstore import StoreSettings, open_store

        rate = parse_size(settings.upload_max_rate) if settings.upload_max_rate else None
        store_settings = dataclasses.replace(StoreSettings.from_env(), upload_max_rate=rate)
        persister = Persister(
            service,
            open_store(settings.persist_url, store_settings),
            concurrency=settings.upload_concurrency,
            keep_last=settings.persist_keep_last,
            nice=settings.background_nice,
        )
        service.add_listener(persister)
    durable = persister.manifest if persister is not None else None
    node = Node(
        service,
        Restorer(service, durable=persister, ring=SpanningReads(service, durable=durable)),
        persister,
        metrics_namespace_labels=settings.metrics_namespace_labels,
        drain_timeout_s=settings.drain_timeout_s,
    )
    if settings.peers:
        _add_peers(node, settings)
    return node


def _add_peers(node: Node, settings: DaemonSettings) -> None:
    """The peer kit: one client, one ring, one copier, and the parts that share them."""
    assert settings.peer_secret is not None and settings.node_name is not None  # validated
    service, name = node.service, settings.node_name
    membership = Membership.parse(settings.peers or "")
    # The one list of who may receive the peer token (the client checks every request).
    client = PeerClient(
        settings.peer_secret.get_secret_value(),
        members=Members(membership, name),
        timeout_s=settings.peer_timeout_s,
        tls=settings.peer_tls,
    )
    ring = Ring(membership, name, replicas=settings.replicas)
    client.answered = ring.peer_ok
    copier = Copier(
        service,
        client,
        concurrency=settings.replication_concurrency,
        nice=settings.background_nice,
        replication_pace=_bucket(settings.replication_max_rate, settings),
        fetch_pace=_bucket(settings.peer_fetch_max_rate, settings),
    )
    node.client, node.ring, node.copier = client, ring, copier
    node.replicator = Replicator(service, ring, client, copier, nice=settings.background_nice)
    service.add_listener(node.replicator)
    node.cluster = ClusterLister(service, membership, client, node=name)
    node.committer = GlobalCommitter(
        service,
        client,
        node=name,
        decider_gone_s=settings.decider_gone_s,
        resend_for_s=settings.decision_resend_s,
        fanout=settings.commit_fanout,
    )
    durable = node.persister.manifest if node.persister is not None else None
    node.fetcher = PeerFetcher(
        service, client, ring, copier, durable=durable, list_wait_s=settings.peer_list_timeout_s
    )
    spanning = SpanningReads(service, fetcher=node.fetcher, durable=durable)
    node.restorer = Restorer(service, peers=node.fetcher, durable=node.persister, ring=spanning)
    replicator = node.replicator
    node.replica_wait = ReplicaWait(
        service, client, node=name, last_error=lambda: replicator.status().last_error
    )


def _bucket(rate: str | None, settings: DaemonSettings) -> TokenBucket | None:
    """The daemon's one token bucket for a ``*_max_rate`` setting (None: unpaced)."""
    if not rate:
        return None
    return TokenBucket(parse_size(rate), settings.replication_inflight_bytes)
