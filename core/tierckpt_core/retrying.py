"""The line a retried call logs before it tries again: the error in our words, which attempt
failed and when the next one comes (tenacity's own line names a private function, e.g.
``Retrying ...S3Calls._data_call.<locals>.attempt in 0.2 seconds as it raised ...``)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # tenacity comes with the client and daemon extras, not with the CLI alone
    import tenacity


def log_before_retry(
    logger: logging.Logger, level: int, attempts: int
) -> Callable[[tenacity.RetryCallState], None]:
    """A ``before_sleep`` for :class:`tenacity.Retrying` of at most ``attempts`` attempts."""

    def log(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.log(
            level,
            "%s (attempt %d of %d); trying again in %.1fs",
            error if error is not None else "the call failed",
            state.attempt_number,
            attempts,
            wait,
        )

    return log
