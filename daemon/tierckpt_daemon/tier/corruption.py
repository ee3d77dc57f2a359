"""Corruption that readers on the node found: counted and logged by the daemon.

A trainer that falls back past a corrupt step, and ``tierckpt verify``, check every block they
read against the checksums taken when it was written; the daemon itself never sees those reads.
Each reader reports what it found (``POST /v1/namespaces/{ns}/steps/{step}/corruption``, best
effort), so that ``tierckpt_verification_failures_total{tier}`` and its alert
(``TierckptVerificationFailures``) count every corrupt block found on the node, and the daemon's
log names it: namespace, step, file, block, tier.

A file found corrupt in this node's memory is then checked again by the daemon itself
(:func:`check_later`: on a thread of its own, one per file at a time, the report answered
at once): where the daemon finds it damaged too and the step is durable or replicated to a
peer, the memory copy is dropped, so the next load of "latest" reads the step's verified copy
from there instead of falling back past it on every restore. A step that is
nowhere else keeps its memory copy (its loads fall back, and the alert stands); a report the
daemon cannot confirm changes nothing (a reader's word alone never removes a step).
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from typing import TYPE_CHECKING

from tierckpt_core.errors import CheckpointFormatError, NotFoundError
from tierckpt_core.integrity import checksum_file_blocks
from tierckpt_core.metadata_blob import unpack_metadata
from tierckpt_core.protocol import (
    CorruptionReport,
    StepState,
    validate_file_name,
    validate_namespace,
)
from tierckpt_core.protocol import validate_step as check_step
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.metrics import Metrics
from tierckpt_daemon.tier.records import MANIFEST

if TYPE_CHECKING:
    from tierckpt_daemon.tier.service import TierService

logger = logging.getLogger(__name__)


def corruption_reported(metrics: Metrics, namespace: str, step: int, req: CorruptionReport) -> None:
    validate_namespace(namespace)
    check_step(step)
    if req.file is not None:
        validate_file_name(req.file)
    metrics.verification_failures.labels(tier=req.tier).inc()
    block = f", block {req.block}" if req.block is not None else ""
    logger.error(
        "%s/step %d: a reader found file %s%s corrupt in the %s tier: %s",
        namespace,
        step,
        req.file or "(unknown)",
        block,
        req.tier,
        req.detail or "(no detail)",
        extra={
            **step_fields(namespace, step),
            "file": req.file,
            "block": req.block,
            "tier": req.tier,
        },
    )


_checking: set[tuple[int, str, int, str]] = set()  # (service, namespace, step, file) checked now
_checking_lock = threading.Lock()


def check_later(
    service: TierService, namespace: str, step: int, file: str, owner: str | None
) -> None:
    """:func:`drop_damaged_copy` on a thread of its own, unless one is checking that file (every
    rank of a node that reads it reports it)."""
    key = (id(service), namespace, step, file)
    with _checking_lock:
        if key in _checking:
            return
        _checking.add(key)

    def run() -> None:
        try:
            drop_damaged_copy(service, namespace, step, file, owner)
        finally:
            with _checking_lock:
                _checking.discard(key)

    threading.Thread(target=run, name="tierckpt-corruption-check", daemon=True).start()


def drop_damaged_copy(
    service: TierService, namespace: str, step: int, file: str, owner: str | None
) -> None:
    """Check ``file`` of the step in memory against its record; if it is damaged (its bytes
    changed, cut short, gone, or not a regular file) and the step is durable or has a replica on
    a peer, take the step's memory copy out (as ``tierckpt rm`` does; readers that pin it keep
    it until they are done). Any error is logged, never raised (it runs on a thread nobody
    waits for)."""
    where = f"{namespace}/step {step}"
    try:
        with service.lock:
            rec = service.record(namespace, step, owner=owner)
            f = rec.files.get(file)
            if file != MANIFEST and (f is None or f.checksum is None):
                return  # nothing to check against
            elsewhere = "the persistent tier" if rec.state == StepState.DURABLE else None
            if elsewhere is None and rec.replicated_to:
                elsewhere = f"its replica on {', '.join(rec.replicated_to)}"
            if elsewhere is None:
                logger.info(
                    "%s: %s, reported corrupt: the step is nowhere else (not durable, no replica), "
                    "its memory copy is kept",
                    where,
                    file,
                    extra=step_fields(namespace, step),
                )
                return
        if file == MANIFEST:  # its DCP metadata, which a reader could not decode
            why = _record_damage(service, namespace, step, owner)
        else:
            assert f is not None and f.checksum is not None
            why = _damage(str(rec.dir / file), f.length, f.checksum)
        if why == "":
            return  # could not be checked (said)
        if why is None:
            logger.warning(
                "%s: %s, reported corrupt, matches its checksum here: its memory copy is kept",
                where,
                file,
                extra=step_fields(namespace, step),
            )
            return
        with service.lock:
            if service.record(namespace, step, owner=owner) is not rec:
                return  # saved again since: another copy, not the one checked
            service.index.retire(rec)
            service.metrics.evictions.labels(reason="corrupt").inc()
        logger.warning(
            "%s: %s in memory %s: its memory copy is dropped, and the next load reads the "
            "step from %s, verified",
            where,
            file,
            why,
            elsewhere,
            extra=step_fields(namespace, step),
        )
    except NotFoundError:
        return  # left memory since the report
    except Exception:  # after the answer: nobody else would see it
        logger.exception("%s: checking %s, reported corrupt, failed", where, file)


def _damage(path: str, length: int, want: str) -> str | None:
    """What is wrong with the first ``length`` bytes of tier file ``path`` (written with
    checksum ``want``), None if nothing, "" if it could not be checked. Only what the file
    itself shows counts: gone, a link or not a regular file, shorter than written, or other
    bytes; an error of this process (out of descriptors, of memory) is logged and counts as
    nothing (a copy is never dropped for it)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return "is missing"
    if not stat.S_ISREG(st.st_mode):
        return "was replaced by something other than a regular file"
    if st.st_size < length:
        return f"is {st.st_size} bytes, shorter than the {length} it was written with"
    try:
        got = checksum_file_blocks(path, length)[0]
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENODEV):  # replaced since the lstat
            return f"was replaced while it was checked ({e})"
        logger.warning("could not check %s (%s): its memory copy is kept", path, e)
        return ""
    return "does not match the checksum taken when it was written" if got != want else None


def _record_damage(
    service: TierService, namespace: str, step: int, owner: str | None
) -> str | None:
    """What is wrong with the step's commit record in memory as a reader decodes it first (the
    record, then its DCP metadata inflated and parsed), or None."""
    try:
        manifest = service.manifest(namespace, step, owner=owner)
        if not manifest.metadata_elsewhere:
            unpack_metadata(manifest.metadata, where=f"{namespace}/step {step}")
    except CheckpointFormatError as e:
        return f"is damaged ({e})"
    return None
