"""The daemon's periodic sweep (``service.sweep()`` every ``SWEEP_INTERVAL_S`` from
``api/app.py``): what expires on its own when nobody comes back for it.

Unsealed leases and stalled save attempts (a trainer that died mid-save) are reclaimed after the
lease TTL; expired reader pins are dropped, so retention can take their steps; pool files idle for
``POOL_IDLE_S`` give their memory back; a retired step still waiting for its upload or replica is
let go by its worker now, not at its next retry. A prepared attempt of a step spanning nodes is
never reclaimed here: it waits for its decider (:mod:`tierckpt_daemon.peers.commit` resolves it).

:class:`~tierckpt_daemon.tier.service.TierService` inherits this, so its lock is taken inside it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.tier.arena import Arena
from tierckpt_daemon.tier.index import StepIndex
from tierckpt_daemon.tier.leases import Leases

if TYPE_CHECKING:
    from tierckpt_daemon.tier.service import StepListener

logger = logging.getLogger(__name__)

POOL_IDLE_S = 900.0


class Housekeeping:
    lock: threading.RLock
    index: StepIndex
    leases: Leases
    arena: Arena
    lease_ttl_s: float
    _listeners: list[StepListener]

    def sweep(self) -> None:
        """Expire leases, stalled saves and pins; trim long-idle pool files."""
        now = time.monotonic()
        index = self.index
        with self.lock:
            self.leases.expire(now)
            for rec in list(index.writing.values()):
                if rec.prepared_at is None and now - rec.last_activity > self.lease_ttl_s:
                    logger.warning(
                        "%s/step %d: save attempt %s stalled for %.0fs; reclaiming its files",
                        rec.namespace,
                        rec.step,
                        rec.attempt,
                        now - rec.last_activity,
                        extra=step_fields(rec.namespace, rec.step, rec.attempt),
                    )
                    index.abandon(rec)
            for rec in index.all_committed() + index.retiring:
                for pin_id in [p for p, exp in rec.pins.items() if exp < now]:
                    del rec.pins[pin_id]
                index.drop_if_retired(rec)
            self.arena.trim_pool(0, idle_s=POOL_IDLE_S)
            waiting = [r for r in index.retiring if r.persist_pending or r.replication_pending]
        # Retired while an upload or a replica waited for a retry (minutes away after a few
        # failures): its worker lets it go now. Told outside the lock (the workers take their own).
        for rec in waiting:
            for listener in self._listeners:
                listener.retired(rec)
