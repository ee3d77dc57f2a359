"""When each namespace last committed a step, and last made one durable, on this node.

The ``tierckpt_seconds_since_committed_step`` and ``tierckpt_seconds_since_durable_step`` gauges are
computed from these wall-clock times at every scrape, so a stalled job shows as a number that keeps
growing rather than as a counter that merely stops moving. ``tierckpt_due_steps_since_durable``
counts the steps committed for the persistent tier (due under ``TIERCKPT_PERSIST_EVERY`` or asked
for) since this node last made one durable (or uploaded its share of a step spanning nodes, which
the step's decider makes durable): uploads that keep pace hold it at 1 or 2, whatever
the time between saves, so an alert on it does not depend on how often a job saves.

What counts: a save committed here (a trainer's commit, or this node's share of a step spanning
nodes) and an upload that made a step durable from here. Replicas received from peers and steps
brought back for a reader (hydrated, or restored from a peer) do not count: they are not progress of
the job. After a daemon restart the times are seeded from the steps the job saved that are still in
memory (their commit records keep both times); a namespace with none has no series until its next
commit.

Cardinality is bounded: at most ``limit`` namespaces are tracked (the most recently active); a
namespace pushed out loses its series until its next commit.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tierckpt_daemon.tier.records import StepRecord, filled_by_daemon

MAX_NAMESPACES = 64


@dataclass
class Times:
    committed_at: float | None = None
    durable_at: float | None = None
    due: int = 0  # steps committed for the persistent tier since the last durable one


class Freshness:
    """Per-namespace times of the last commit and the last durable step (thread-safe)."""

    def __init__(
        self, limit: int = MAX_NAMESPACES, *, clock: Callable[[], float] = time.time
    ) -> None:
        if limit < 1:
            raise ValueError(f"the namespace limit must be at least 1, got {limit}")
        self.limit = limit
        self.clock = clock
        self._lock = threading.Lock()
        self._times: OrderedDict[str, Times] = OrderedDict()

    def committed(self, namespace: str, at: float | None = None, *, due: bool = False) -> None:
        """A step of ``namespace`` committed (``due``: for the persistent tier)."""
        self._set(namespace, committed_at=self.clock() if at is None else at, due=int(due))

    def durable(self, namespace: str, at: float | None = None) -> None:
        self._set(namespace, durable_at=self.clock() if at is None else at, due=None)

    def seed(self, records: Iterable[StepRecord]) -> None:
        """Take the times from the commit records of steps in memory (after a restart)."""
        for rec in sorted(records, key=lambda r: r.committed_at or 0.0):
            if rec.origin is not None or filled_by_daemon(rec.attempt):
                continue  # a replica of a peer's step, or one brought back for a reader
            if rec.committed_at:
                # Still to be uploaded, or a share up whose step is not known durable here.
                due = int(rec.persist_pending or rec.share_uploaded)
                self._set(rec.namespace, committed_at=rec.committed_at, newer_only=True, due=due)
            if rec.durable_at:  # in commit order: the steps after it count again
                self._set(rec.namespace, durable_at=rec.durable_at, newer_only=True, due=None)

    def ages(self) -> dict[str, tuple[float | None, float | None]]:
        """Seconds since the last commit and the last durable step, per namespace (None: none
        since the daemon started, nor in memory)."""
        now = self.clock()
        with self._lock:
            return {
                ns: (
                    None if t.committed_at is None else max(0.0, now - t.committed_at),
                    None if t.durable_at is None else max(0.0, now - t.durable_at),
                )
                for ns, t in self._times.items()
            }

    def due_steps(self) -> dict[str, int]:
        """Steps committed for the persistent tier since the last durable one, per namespace."""
        with self._lock:
            return {ns: t.due for ns, t in self._times.items()}

    def _set(
        self,
        namespace: str,
        *,
        committed_at: float | None = None,
        durable_at: float | None = None,
        newer_only: bool = False,
        due: int | None = 0,
    ) -> None:
        """Set the times given (``newer_only``: only where newer) and add ``due`` to the count of
        due steps (None: a step became durable, the count starts again)."""
        with self._lock:
            t = self._times.get(namespace)
            if t is None:
                t = self._times[namespace] = Times()
            t.due = 0 if due is None else t.due + due
            for name, value in (("committed_at", committed_at), ("durable_at", durable_at)):
                old = getattr(t, name)
                if value is not None and not (newer_only and old is not None and old >= value):
                    setattr(t, name, value)
            self._times.move_to_end(namespace)
            while len(self._times) > self.limit:
                self._times.popitem(last=False)
