"""Background threads that die are seen: in the log, in a metric, in the daemon's status.

Every thread of the daemon catches what it expects (an upload that fails is retried, a peer that
does not answer is skipped). What escapes is a bug or an unforeseen failure, and it used to end
the thread with a traceback on stderr and nothing else: uploads stopped while the status said
"health unknown". :class:`ThreadFailures` is installed as ``threading.excepthook`` while the
daemon serves; for each thread that dies it

- logs the traceback at ERROR through ``logging`` (so it is one JSON object with
  ``TIERCKPT_LOG_JSON``), naming the thread;
- counts ``tierckpt_background_thread_failures_total{thread}`` (alert
  ``TierckptBackgroundThreadDied``);
- adds a line to ``/v1/status``'s ``failed_threads``, which ``tierckpt status`` shows as
  ``health UNHEALTHY``.

The owner of a worker thread also marks its own status (the uploader: ``persistent`` unhealthy,
``tierckpt_persistent_healthy 0``; see ``QueueWorker._died``).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable

from prometheus_client import Counter

logger = logging.getLogger(__name__)

# Pool threads are named prefix_N (ThreadPoolExecutor); the label is the prefix, so that its
# values stay few.
_POOL_SUFFIX = re.compile(r"_\d+$")
MAX_KEPT = 16  # lines kept for the status: the first failures say the most


def thread_label(name: str) -> str:
    return _POOL_SUFFIX.sub("", name)


class ThreadFailures:
    """The threads of one daemon that died, and the hook that records them."""

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._lock = threading.Lock()
        self._failed: list[str] = []

    def record(self, thread: str, error: BaseException, *, died: bool = True) -> None:
        """Count and keep ``thread``'s failure; ``died=False`` for a loop that goes on (the
        sweeper): still a bug the operator must see."""
        label = thread_label(thread)
        self._counter.labels(thread=label).inc()
        what = f"{type(error).__name__}: {error}"
        line = (
            f"thread {thread} died of {what}" if died else f"{thread} failed ({what}); it goes on"
        )
        with self._lock:
            if len(self._failed) < MAX_KEPT:
                self._failed.append(line)

    def failed(self) -> list[str]:
        with self._lock:
            return list(self._failed)

    def hook(self, args: threading.ExceptHookArgs) -> None:
        """A ``threading.excepthook``."""
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "unknown"
        error = args.exc_value if args.exc_value is not None else args.exc_type()
        logger.error(
            "background thread %s died of %s: %s; the daemon keeps serving without it "
            "(restart the daemon to bring it back)",
            name,
            args.exc_type.__name__,
            error,
            exc_info=(args.exc_type, error, args.exc_traceback),
            extra={"thread_name": name},
        )
        self.record(name, error)

    def install(self) -> Callable[[], None]:
        """Make :meth:`hook` the process's ``threading.excepthook``; returns the undo."""
        previous = threading.excepthook
        threading.excepthook = self.hook

        def restore() -> None:
            threading.excepthook = previous

        return restore
