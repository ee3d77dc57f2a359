"""Prometheus metrics of the daemon, served at ``/metrics`` on the TCP port.

Counters and histograms are updated where things happen; gauges of the tier's state are computed
from the service when Prometheus scrapes, so they can never drift from the truth.

Labels stay bounded: ``state`` and ``reason`` take a few fixed values; ``namespace`` (only on the
two "seconds since" gauges and ``tierckpt_due_steps_since_durable``) is limited to the most
recently active namespaces
(:data:`tierckpt_daemon.tier.freshness.MAX_NAMESPACES`).

``/metrics`` needs no token (the TCP port serves it to anyone who reaches it), and a namespace's
name can say whose job it is: by default (``TIERCKPT_METRICS_NAMESPACE_LABELS=hashed``) the label is
a short hash of the name (:func:`namespace_label`), the same on every node, so that dashboards and
alerts still group by it; ``plain`` shows names, ``off`` drops the per-namespace series (of
``tierckpt_due_steps_since_durable`` one series is left, the highest count, for its alert).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import platform
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Where a block that failed its checksum came from: this node's memory (found by a trainer), a
# peer's replica, the persistent tier.
VERIFIED_TIERS = ("memory", "peer", "persistent")
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_TRANSFER_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


class Metrics:
    def __init__(self) -> None:
        # No `_created` series beside each counter and histogram: Prometheus does not use them,
        # and they doubled the number of series. (A process-wide switch; the daemon's metrics are
        # the only ones in its process.)
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lease_seconds = Histogram(
            "tierckpt_lease_seconds", "Time to grant a lease", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.commit_seconds = Histogram(
            "tierckpt_commit_seconds", "Time to commit a step", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.leases = Counter("tierckpt_leases", "Leases granted", ["recycled"], registry=r)
        self.leased_bytes = Counter("tierckpt_leased_bytes", "Bytes leased", registry=r)
        self.commits = Counter("tierckpt_commits", "Steps committed", registry=r)
        self.capacity_rejections = Counter(
            "tierckpt_capacity_rejections", "Leases refused for lack of capacity", registry=r
        )
        self.evictions = Counter(
            "tierckpt_evictions", "Steps that left memory", ["reason"], registry=r
        )
        self.uploaded_bytes = Counter(
            "tierckpt_uploaded_bytes", "Bytes uploaded to the persistent tier", registry=r
        )
        self.uploaded_steps = Counter("tierckpt_uploaded_steps", "Steps made durable", registry=r)
        self.upload_failures = Counter(
            "tierckpt_upload_failures", "Failed step uploads (retried)", registry=r
        )
        self.upload_skips = Counter(
            "tierckpt_upload_skips",
            "Steps queued for the persistent tier that left memory before their upload started",
            ["reason"],
            registry=r,
        )
        self.upload_seconds = Histogram(
            "tierckpt_upload_seconds",
            "Time to make one step durable",
            registry=r,
            buckets=_TRANSFER_BUCKETS,
        )
        self.hydrated_bytes = Counter(
            "tierckpt_hydrated_bytes", "Bytes brought back from the persistent tier", registry=r
        )
        self.verification_failures = Counter(
            "tierckpt_verification_failures",
            "Blocks whose checksum did not match when read back, by the tier they came from "
            "(found by this daemon, or reported by a reader on the node)",
            ["tier"],
            registry=r,
        )
        for tier in VERIFIED_TIERS:  # every series from 0, so that increase() sees the first
            self.verification_failures.labels(tier=tier)
        self.thread_failures = Counter(
            "tierckpt_background_thread_failures",
            "Background threads of the daemon that died of an unexpected error",
            ["thread"],
            registry=r,
        )
        # RSS, open file descriptors, CPU seconds, start time (process_*; Linux only).
        ProcessCollector(registry=r)

        self.replicated_bytes = Counter(
            "tierckpt_replicated_bytes", "Bytes pushed to peers as replicas", registry=r
        )
        self.replicated_steps = Counter(
            "tierckpt_replicated_steps", "Step replicas pushed to peers", registry=r
        )
        self.replication_failures = Counter(
            "tierckpt_replication_failures",
            "Replication rounds that left a step short of replicas (retried)",
            registry=r,
        )
        self.replica_received_bytes = Counter(
            "tierckpt_replica_received_bytes", "Bytes of replicas received from peers", registry=r
        )
        self.peer_hydrated_bytes = Counter(
            "tierckpt_peer_hydrated_bytes", "Bytes brought back from peers' replicas", registry=r
        )
        self.replicas_received = Counter(
            "tierckpt_replicas_received", "Step replicas received from peers", registry=r
        )
        self.replication_skips = Counter(
            "tierckpt_replication_skips",
            "Committed steps never replicated: they left memory first, or no peer was a member",
            ["reason"],
            registry=r,
        )

        self.decision_deliveries_abandoned = Counter(
            "tierckpt_decision_deliveries_abandoned",
            "Decisions of commits across nodes no longer sent to a participant that did not "
            "take them",
            ["reason"],
            registry=r,
        )

    @staticmethod
    def total(counter: Counter) -> int:
        """A counter's value, summed over its labels (one source of truth for the status API
        and /metrics)."""
        return int(
            sum(
                sample.value
                for metric in counter.collect()
                for sample in metric.samples
                if sample.name.endswith("_total")
            )
        )

    def attach(self, snapshot: Callable[[], Snapshot], namespace_labels: str = "hashed") -> None:
        """Compute the state gauges from ``snapshot()`` at every scrape, their namespaces
        labelled as ``namespace_labels`` says (``hashed``, ``plain`` or ``off``)."""
        if namespace_labels not in NAMESPACE_LABELS:
            raise ValueError(f"namespace_labels must be one of {NAMESPACE_LABELS}")
        self.registry.register(_StateCollector(snapshot, namespace_labels))


NAMESPACE_LABELS = ("hashed", "plain", "off")


def namespace_label(namespace: str, mode: str = "hashed") -> str:
    """The ``namespace`` label of ``namespace``'s series: the name itself (``plain``), or the first
    12 hex digits of the SHA-256 of its UTF-8 bytes (``hashed``; in a shell,
    ``printf %s NAME | sha256sum | cut -c1-12``). A hash hides a name from whoever scrapes, not
    from someone who guesses it: ``off`` for that."""
    if mode == "plain":
        return namespace
    return hashlib.sha256(namespace.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class Snapshot:
    capacity_bytes: int
    bytes_by_state: dict[str, int]
    steps_by_state: dict[str, int]
    upload_queue: int = 0
    persistent_healthy: bool | None = None
    replication_queue: int = 0
    # namespace -> seconds since its last committed step, since its last durable step (None: none)
    ages: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    # namespace -> steps committed for the persistent tier since its last durable step
    due_steps: dict[str, int] = field(default_factory=dict)


def build_labels() -> dict[str, str]:
    """The ``tierckpt_build_info`` labels: this package's version, Python's, and torch's when it
    is installed (read from its distribution metadata: the daemon never imports torch)."""
    from tierckpt_daemon import __version__

    labels = {"version": __version__, "python": platform.python_version()}
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        labels["torch"] = importlib.metadata.version("torch")
    return labels


class _StateCollector(Collector):
    def __init__(self, snapshot: Callable[[], Snapshot], namespace_labels: str) -> None:
        self.snapshot = snapshot
        self.namespace_labels = namespace_labels
        self.build = build_labels()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        build = GaugeMetricFamily(
            "tierckpt_build_info",
            "Always 1; the labels say which tierckpt, Python and torch (if installed) run",
            labels=sorted(self.build),
        )
        build.add_metric([self.build[k] for k in sorted(self.build)], 1)
        yield build
        snap = self.snapshot()
        cap = GaugeMetricFamily("tierckpt_capacity_bytes", "Budget of the memory tier")
        cap.add_metric([], snap.capacity_bytes)
        yield cap
        mem = GaugeMetricFamily(
            "tierckpt_memory_bytes", "Bytes held in the memory tier", labels=["state"]
        )
        for state, n in sorted(snap.bytes_by_state.items()):
            mem.add_metric([state], n)
        yield mem
        steps = GaugeMetricFamily("tierckpt_steps", "Steps held in memory", labels=["state"])
        for state, n in sorted(snap.steps_by_state.items()):
            steps.add_metric([state], n)
        yield steps
        queue = GaugeMetricFamily(
            "tierckpt_upload_queue_steps", "Committed steps waiting to be persisted"
        )
        queue.add_metric([], snap.upload_queue)
        yield queue
        healthy = GaugeMetricFamily(
            "tierckpt_persistent_healthy",
            "1 if the last persistent-tier operation succeeded, 0 if it failed, absent if unknown",
        )
        if snap.persistent_healthy is not None:
            healthy.add_metric([], 1.0 if snap.persistent_healthy else 0.0)
        yield healthy
        replication = GaugeMetricFamily(
            "tierckpt_replication_queue_steps", "Committed steps waiting for replicas on peers"
        )
        replication.add_metric([], snap.replication_queue)
        yield replication
        since_commit = GaugeMetricFamily(
            "tierckpt_seconds_since_committed_step",
            "Seconds since this node last committed a step of the namespace (absent before one)",
            labels=["namespace"],
        )
        since_durable = GaugeMetricFamily(
            "tierckpt_seconds_since_durable_step",
            "Seconds since this node last made a step of the namespace durable (absent before one)",
            labels=["namespace"],
        )
        mode = self.namespace_labels
        ages = sorted(snap.ages.items()) if mode != "off" else []
        for ns, (committed, durable) in ages:
            label = namespace_label(ns, mode)
            if committed is not None:
                since_commit.add_metric([label], committed)
            if durable is not None:
                since_durable.add_metric([label], durable)
        yield since_commit
        yield since_durable
        due = GaugeMetricFamily(
            "tierckpt_due_steps_since_durable",
            "Steps of the namespace committed here for the persistent tier since this node last "
            "made one durable (1 or 2 while uploads keep pace)",
            labels=["namespace"],
        )
        if mode == "off":  # one series without the label: the highest count of any namespace
            if snap.due_steps:
                due.add_metric([""], max(snap.due_steps.values()))
        else:
            for ns, n in sorted(snap.due_steps.items()):
                due.add_metric([namespace_label(ns, mode)], n)
        yield due
