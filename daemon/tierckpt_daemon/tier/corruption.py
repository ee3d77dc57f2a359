"""Corruption that readers on the node found: counted and logged by the daemon.

A trainer that falls back past a corrupt step, and ``tierckpt verify``, check every block they
read against the checksums taken when it was written; the daemon itself never sees those reads.
Each reader reports what it found (``POST /v1/namespaces/{ns}/steps/{step}/corruption``, best
effort), so that ``tierckpt_verification_failures_total{tier}`` and its alert
(``TierckptVerificationFailures``) count every corrupt block found on the node, and the daemon's
log names it: namespace, step, file, block, tier.
"""

from __future__ import annotations

import logging

from tierckpt_core.protocol import CorruptionReport, validate_file_name, validate_namespace
from tierckpt_core.protocol import validate_step as check_step
from tierckpt_daemon.logfields import step_fields
from tierckpt_daemon.metrics import Metrics

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
