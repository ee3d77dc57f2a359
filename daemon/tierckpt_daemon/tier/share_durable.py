"""A participant of a step spanning nodes learns that the step became durable.

Each node uploads its own share of such a step; the decider (the daemon of the step's rank 0)
writes the step's manifest and ``COMMITTED`` marker once every share is there. Nothing tells
the other nodes when: their record stayed ``committed`` for good, so a rank that waited on its
own node's daemon for the step to become durable (a preemption's save, ``tierckpt persist
--wait``) waited its whole deadline and failed, with the step durable all along.

Now a participant whose share is uploaded reads the marker when asked about the step (a
step's state read, a persist requested), at most once every :data:`CHECK_S`: where the marker
is there, of this attempt, and the manifest lists this node's share with the checksums it
uploaded, the step is durable here too (``tierckpt_due_steps_since_durable`` resets).
Unasked, the daemon reads the marker of each namespace's newest such step every housekeeping
sweep (:func:`newest_waiting`): the due count of a participant restarts only once the step is
durable, so ``TierckptNoDurableStep`` fires on it too when the decider never writes the marker
(its node replaced before its upload finished, say).
"""

from __future__ import annotations

import logging
import time

from tierckpt_core.errors import NotFoundError, TierCkptError
from tierckpt_core.layout import read_step_manifest
from tierckpt_core.objectstore import ObjectStore
from tierckpt_core.protocol import StepState
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.tier.records import StepRecord
from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)

CHECK_S = 1.0  # a preemption's wait polls every 0.5 s: one S3 read a second per waiting step


def waits_for_marker(rec: StepRecord, node: str | None) -> bool:
    """Whether ``rec`` is this participant's share, uploaded, of a step not durable here."""
    return (
        rec.spans_nodes
        and rec.share_uploaded
        and rec.state == StepState.COMMITTED
        and rec.coordinator != node
    )


def learn_durable(
    service: TierService, store: ObjectStore, namespace: str, step: int, owner: str | None
) -> None:
    """Read ``namespace/step``'s marker if this node waits for it (see the module); errors are
    logged at INFO and leave the step as it is (the next ask reads again)."""
    try:
        with service.lock:
            rec = service.record(namespace, step, owner=owner)
            if not waits_for_marker(rec, service.node):
                return
            now = time.monotonic()
            # One read at a time per step, at most once a CHECK_S: with the tier hung, the
            # waiting ranks' requests must not pile up on reads (each up to its timeouts).
            if rec.marker_reading or now - rec.marker_read_at < CHECK_S:
                return
            rec.marker_read_at = now
            rec.marker_reading = True
            mine = {n: f.checksum for n, f in rec.files.items() if f.node == service.node}
    except NotFoundError:
        return
    try:
        manifest = read_step_manifest(store, namespace, step)
    except NotFoundError:
        return  # the decider has not written it yet
    except (TierCkptError, OSError) as e:
        logger.info("%s/step %d: cannot read its marker yet: %s", namespace, step, e)
        return
    finally:
        with service.lock:
            rec.marker_reading = False
    theirs = {f.name: f.checksum for f in manifest.files if f.name in mine}
    if manifest.attempt != rec.attempt or theirs != mine:
        # INFO: a step saved again (a resume) shows the old attempt's marker until the decider
        # replaces it, and this is asked every second while ranks wait.
        logger.info(
            "%s/step %d: the persistent tier holds another save of this step (attempt %s, not "
            "%s, or other files for this node's share): this node's copy is not durable",
            namespace,
            step,
            manifest.attempt,
            rec.attempt,
            extra=step_fields(namespace, step, rec.attempt),
        )
        return
    service.mark_durable(rec, {}, uploaded=True)
    logger.info(
        "%s/step %d durable in %s (its decider %s wrote the marker)",
        namespace,
        step,
        store.url,
        rec.coordinator,
        extra=step_fields(namespace, step, rec.attempt),
    )


def newest_waiting(service: TierService) -> list[tuple[str, int, str | None]]:
    """Of each namespace, the newest step whose marker this participant waits for."""
    newest: dict[str, StepRecord] = {}
    with service.lock:
        for rec in service.index.all_committed():
            held = newest.get(rec.namespace)
            if waits_for_marker(rec, service.node) and (held is None or held.step < rec.step):
                newest[rec.namespace] = rec
        return [(r.namespace, r.step, r.owner) for r in newest.values()]
