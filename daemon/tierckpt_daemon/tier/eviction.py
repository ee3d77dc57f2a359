"""Which committed steps leave the memory tier, and when.

A policy answers two questions about one namespace's committed steps: which to drop right after a
commit (retention), and in which order steps may be dropped when a lease does not fit (pressure).
The service never evicts a pinned step (a reader is copying out of it) and never the newest committed
step of a namespace, and never a step that is waiting to be persisted or replicated
(:func:`safe_to_evict`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

from tierckpt_daemon.tier.records import StepRecord


class EvictionPolicy(Protocol):
    def after_commit(self, committed: Sequence[StepRecord]) -> list[StepRecord]:
        """Steps of one namespace to evict now that a new step is committed."""
        ...

    def under_pressure(self, committed: Sequence[StepRecord]) -> list[StepRecord]:
        """Steps of one namespace that may go to make room now, the first to go first."""
        ...


class KeepLatestN:
    """Keep the newest ``n`` committed steps of each namespace (``TIERCKPT_KEEP_LAST``)."""

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"keep_last must be >= 1, got {n}")
        self.n = n

    def after_commit(self, committed: Sequence[StepRecord]) -> list[StepRecord]:
        # Pinned steps are included: the service defers their files until the reader unpins.
        # Steps hydrated for a reader stay until it is done (``StepRecord.hold_until``).
        # Of the steps waiting for their upload, the one being uploaded and the newest stay until
        # they are durable: else, with saves faster than uploads (or the tier down for a while),
        # every step due for the persistent tier left memory before its upload and none became
        # durable. Older ones still waiting go (each said and counted as skipped): the newest
        # is the one worth having.
        newest_first = sorted(committed, key=lambda r: r.step, reverse=True)
        newest_due = next((r for r in newest_first if r.persist_pending), None)
        return [
            r
            for r in newest_first[self.n :]
            if not held(r) and not r.uploading and r is not newest_due
        ]

    def under_pressure(self, committed: Sequence[StepRecord]) -> list[StepRecord]:
        oldest_first = sorted(committed, key=lambda r: r.step)
        return [r for r in oldest_first[:-1] if safe_to_evict(r)]


def held(record: StepRecord) -> bool:
    """Whether ``record`` was hydrated for a reader that has not read it yet."""
    return record.hold_until > time.monotonic()


def safe_to_evict(record: StepRecord) -> bool:
    """A step may leave memory only if no reader holds it and no upload or push still needs it."""
    return (
        not record.pins
        and not held(record)
        and not record.persist_pending
        and not record.replication_pending
    )
