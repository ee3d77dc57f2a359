"""Structured fields of the daemon's log lines: which namespace, step, rank and save attempt a line
is about, as keys of its own in the JSON log (``TIERCKPT_LOG_JSON``), so a log pipeline can filter
on ``namespace="llama-7b"`` without parsing messages.

Log calls pass them with ``extra=step_fields(...)``; the JSON formatter in ``__main__`` writes every
one that is set. The text format leaves them out (its messages already say the same).
"""

from __future__ import annotations

import logging
from typing import Any

# thread_name: a background thread that died (:mod:`.failures`); file, block, tier: corruption a
# reader reported (api/corruption.py).
FIELDS = ("namespace", "step", "rank", "attempt", "thread_name", "file", "block", "tier")


def step_fields(
    namespace: str | None = None,
    step: int | None = None,
    attempt: str | None = None,
    *,
    rank: int | None = None,
) -> dict[str, Any]:
    """The ``extra=`` of a log call about ``namespace``/``step``/``attempt``/``rank`` (those
    known; the others are left out rather than logged as null)."""
    fields = {"namespace": namespace, "step": step, "rank": rank, "attempt": attempt}
    return {k: v for k, v in fields.items() if v is not None}


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields a log record carries."""
    return {k: getattr(record, k) for k in FIELDS if getattr(record, k, None) is not None}
