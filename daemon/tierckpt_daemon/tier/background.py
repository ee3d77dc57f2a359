"""Threads that move checkpoint bytes in the background (uploads, hydration, replica pushes) run at
a lower CPU priority than the training processes on the node (``TIERCKPT_BACKGROUND_NICE``).

Linux keeps a niceness per thread, and a thread inherits its creator's, so the native threads a
worker starts (the S3 CRT client's event loops, created on first use) run niced too. Raising one's
own niceness needs no privilege. An idle node runs niced threads at full speed: the setting only
decides who yields when training and a transfer want the same core.

:class:`QueueWorker` is the one background worker both the uploader and the replicator are built
on: a due-time queue, a thread, retries with backoff, draining and stopping.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)


def lower_priority(nice: int) -> None:
    """Set the calling thread's niceness to ``nice`` (0: leave it alone).

    Only ever lowers the priority: a daemon started niced (``nice -n 15 tierckpt-daemon``) keeps
    its background threads at least as nice as itself, never above the threads that answer the
    trainers (and a non-root daemon could not raise it anyway).
    """
    tid = threading.get_native_id()
    if nice <= 0 or os.getpriority(os.PRIO_PROCESS, tid) >= nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError as e:  # e.g. a seccomp profile that forbids it: run at normal priority
        logger.warning("could not lower the priority of a background thread: %s", e)


def background_pool(workers: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A thread pool whose threads run at niceness ``nice``."""
    return ThreadPoolExecutor(
        max(1, workers), thread_name_prefix=name, initializer=lower_priority, initargs=(nice,)
    )


T = TypeVar("T")


class QueueWorker(Generic[T]):
    """One niced thread that works through a queue of items in due order, with retries.

    Subclasses implement :meth:`_process` (True: done; False or an exception: try the item again
    after a backoff of ``retry_base_s`` doubling up to ``retry_max_s``; a number: not done, and
    not failing either, look again in that many seconds). A failing item waits for its retry
    while the items behind it go ahead. Used by the uploader and the replicator; their
    items are step records, which are compared by identity.
    """

    def __init__(self, name: str, *, nice: int, retry_base_s: float, retry_max_s: float) -> None:
        self.name = name
        self.nice = nice
        self.retry_base_s = retry_base_s
        self.retry_max_s = retry_max_s
        self._queue: list[tuple[float, int, T]] = []  # (due, seq, item): a heap
        self._seq = itertools.count()
        self._tries: dict[int, int] = {}  # id(item) -> failed rounds so far
        self._cv = threading.Condition()
        self._current: T | None = None
        self._stop = False
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def enqueue(self, item: T, delay_s: float = 0.0) -> None:
        with self._cv:
            if item is self._current or any(q is item for _, _, q in self._queue):
                return  # already queued, or being worked on
            heapq.heappush(self._queue, (time.monotonic() + delay_s, next(self._seq), item))
            self._cv.notify_all()

    def hurry(self, item: T) -> None:
        """Make ``item`` due now (queued for a later retry, or not queued at all); nothing if it
        is being worked on."""
        with self._cv:
            if item is self._current:
                return
            self._queue = [e for e in self._queue if e[2] is not item]
            heapq.heapify(self._queue)
            heapq.heappush(self._queue, (time.monotonic(), next(self._seq), item))
            self._cv.notify_all()

    def queued(self) -> int:
        """Items waiting or being worked on."""
        with self._cv:
            return len(self._queue) + (self._current is not None)

    def wait_idle(self, timeout_s: float, *, retries: bool = False) -> bool:
        """Wait until nothing is due or being worked on (with ``retries``: until the queue is
        empty, items waiting to be retried included): True, or False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._current is not None or (
                self._queue and (retries or self._queue[0][0] <= time.monotonic())
            ):
                left = deadline - time.monotonic()
                if left <= 0 or (self._thread.ident is not None and not self._thread.is_alive()):
                    return False  # out of time, or nobody left to work the queue
                self._cv.wait(min(left, 0.2))
        return True

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _process(self, item: T) -> bool | float:
        raise NotImplementedError

    def _main(self) -> None:
        try:
            self._run()
        except BaseException as e:
            # The worker is gone for good: let its owner say so in its status, then let the
            # exception reach threading.excepthook (the log and a metric, :mod:`..failures`).
            self._died(e)
            raise

    def _died(self, error: BaseException) -> None:
        """The worker's thread died of ``error``: subclasses mark their status unhealthy."""

    def _run(self) -> None:
        lower_priority(self.nice)
        while True:
            with self._cv:
                while not self._stop:
                    now = time.monotonic()
                    if self._queue and self._queue[0][0] <= now:
                        break
                    self._cv.wait(self._queue[0][0] - now if self._queue else None)
                if self._stop:
                    return
                _, _, item = heapq.heappop(self._queue)
                self._current = item
            try:
                done = self._process(item)
            except Exception:  # a bug must not kill the worker: say so, retry the item later
                logger.exception("%s: processing %r failed", self.name, item)
                done = False
            with self._cv:
                self._current = None
                if done is True:
                    self._tries.pop(id(item), None)
                elif done is not False:  # not done, not failing: waiting on something else
                    self._tries.pop(id(item), None)
                    heapq.heappush(self._queue, (time.monotonic() + done, next(self._seq), item))
                else:
                    tries = self._tries[id(item)] = self._tries.get(id(item), 0) + 1
                    delay = min(self.retry_base_s * 2 ** (tries - 1), self.retry_max_s)
                    heapq.heappush(self._queue, (time.monotonic() + delay, next(self._seq), item))
                self._cv.notify_all()

    def failing(self, besides: T | None = None) -> int:
        """Items whose last try failed and that wait for the next one (``besides`` not counted)."""
        with self._cv:
            return sum(1 for k in self._tries if besides is None or k != id(besides))

    def retry_delay(self, item: T) -> float:
        """The backoff the next failure of ``item`` will wait."""
        with self._cv:
            tries = self._tries.get(id(item), 0) + 1
        return min(self.retry_base_s * 2 ** (tries - 1), self.retry_max_s)
