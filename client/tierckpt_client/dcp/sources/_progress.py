"""INFO lines while a long read runs: a restore from the persistent tier takes minutes on S3, and
a trainer's log that says nothing for minutes looks hung. Nothing is logged for a read that ends
within the first interval."""

from __future__ import annotations

import logging
import threading
import time

# The reader's logger: where users (and their log filters) find what a load read from.
logger = logging.getLogger("tierckpt_client.dcp.reader")

INTERVAL_S = 10.0  # between two progress lines (and before the first)


class Progress:
    """Bytes of one read that have landed, counted from any thread; a line every ``interval_s``."""

    def __init__(self, what: str, total: int, *, interval_s: float = INTERVAL_S) -> None:
        self.what = what
        self.total = total
        self.interval_s = interval_s
        self.done_bytes = 0
        self._start = self._last = time.monotonic()
        self._said = False
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.done_bytes += n
            if now - self._last < self.interval_s:
                return
            self._last, self._said, done = now, True, self.done_bytes
        logger.info(
            "%s: %.0f of %.0f MiB read (%.0f%%, %.1f MB/s)",
            self.what,
            done / (1 << 20),
            self.total / (1 << 20),
            100.0 * done / self.total if self.total else 100.0,
            done / max(now - self._start, 1e-9) / 1e6,
        )

    def finish(self) -> None:
        """A last line, when progress lines were logged."""
        if self._said:
            took = time.monotonic() - self._start
            logger.info(
                "%s: all %.0f MiB read in %.0fs", self.what, self.done_bytes / (1 << 20), took
            )
