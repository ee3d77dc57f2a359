"""Staging's copy of CPU tensors into the tier file: raw bytes in runs, shared by the trainer's
thread and a few helper threads, waiting only for the runs under way.

torch's ``copy_`` splits each tensor over its OpenMP threads and waits at a barrier for all of
them, per tensor. On a busy machine a thread the scheduler holds back holds the whole copy: on
the shared 2-core box a 64 MiB copy that takes 3 ms quiet took 100-200 ms in such rounds, and
the stall of ``async_save`` is that copy. Here the bytes of all the tensors are cut into runs of
:data:`RUN` bytes that the trainer's thread and the helpers' take in turn (``memmove`` through
ctypes releases the GIL): a helper that has not started when the trainer's thread runs out of
runs does none, so the copy waits only for runs that are under way, never for a thread that was
not scheduled. Only the plain case goes this way (a contiguous CPU source without conjugate or
negative bit: the same bytes ``copy_`` would write); everything else is ``copy_``.

**Where the helpers run.** After any parallel torch op, the trainer's OpenMP workers spin for
several milliseconds (libgomp's default wait policy) waiting for the next one: a save right after
a training step finds the other cores taken by them. A woken helper then tends to land on the
trainer's own core (the only one the scheduler sees as no busier), and the two share it while the
spinning worker keeps its core: on the 2-core box the copy ran at one thread's speed with a
helper, and a helper often started milliseconds late. So each copy keeps its helpers off the
core the trainer's thread is on when they are woken (an affinity mask of the process's cores less
that one), and each helper lifts the mask as soon as it runs: from then on the scheduler may move
it anywhere, e.g. onto the core the trainer's thread leaves idle while it waits for a helper's
run. (A mask kept for the whole copy measured ~10 % slower on average under load: a helper held
on a busy core could not be moved.)
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from tierckpt_core.verified_copy import copy_bytes

logger = logging.getLogger(__name__)

RUN = 4 << 20
"""Bytes one thread copies at a time: handing a run over costs a few microseconds."""

SPLIT_MIN = 2 * RUN
"""Below this many bytes in all, the trainer's thread copies alone."""


def _move(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (not overlapping), the GIL
    released (:func:`tierckpt_core.verified_copy.copy_bytes`: a vectorised loop, faster than
    libc's ``memmove`` here)."""
    copy_bytes((ctypes.c_uint8 * n).from_address(dst), (ctypes.c_uint8 * n).from_address(src))


def plain(src: torch.Tensor) -> bool:
    """Whether copying ``src`` into a contiguous host tensor of its dtype and shape is a copy of
    its bytes as they are (``src`` in host memory)."""
    return src.is_contiguous() and not src.is_conj() and not src.is_neg()


class ByteCopies:
    """Copies of whole byte ranges, gathered and then run together by :meth:`run`.

    Made with ``threads > 1`` and an ``expect``-ed byte count of at least :data:`SPLIT_MIN`, it
    wakes its helpers at the first :meth:`add` (not before: a helper woken with nothing to copy
    goes back to sleep, and its second wake-up can wait behind whatever holds its core): they
    copy the runs of each :meth:`add` while the trainer's thread lays out the next tensors, and
    :meth:`run` joins them for what is left."""

    def __init__(self, threads: int = 1, expect: int = 0) -> None:
        self._pieces: list[tuple[int, int, int]] = []  # (dst address, src address, bytes)
        self.nbytes = 0
        self._keep: list[torch.Tensor] = []  # the sources stay alive until the copy is done
        self._threads = threads
        self._expect = expect if threads > 1 and expect >= SPLIT_MIN else 0
        self._shared: _Runs | None = None

    def _start(self, threads: int, expect: int) -> None:
        self._shared = _Runs()
        cores = _Cores.now()
        shared = self._shared
        for h in _helpers(min(threads - 1, -(-expect // RUN) - 1, helpers())):
            cores.keep_off(h.tid)  # before it wakes: see the module docstring

            def help_out() -> None:
                cores.release(0)  # running, off the trainer's core: free to move from here on
                shared.work()

            h.submit(help_out)

    def add(self, dst: int, src: torch.Tensor, n: int) -> None:
        """Copy the ``n`` bytes of ``src`` (:func:`plain`) to address ``dst`` by the end of
        :meth:`run` (helpers woken by the constructor may start now)."""
        if not n:
            return
        ptr = src.data_ptr()
        self._keep.append(src)
        self.nbytes += n
        if self._expect and self._shared is None:
            self._start(self._threads, self._expect)
        if self._shared is not None:
            self._shared.add([(dst + at, ptr + at, min(RUN, n - at)) for at in range(0, n, RUN)])
        else:
            self._pieces.append((dst, ptr, n))

    def run(self, threads: int | None = None) -> None:
        """Every copy, on up to ``threads`` threads (default: as made; this one and helpers);
        returns when all the bytes are in place, and no thread writes into a destination after
        that."""
        threads = self._threads if threads is None else threads
        pieces, self._pieces = self._pieces, []
        try:
            if self._shared is None and threads > 1 and self.nbytes >= SPLIT_MIN:
                self._start(threads, self.nbytes)
                assert self._shared is not None
                for dst, src, n in pieces:
                    self._shared.add(
                        [(dst + at, src + at, min(RUN, n - at)) for at in range(0, n, RUN)]
                    )
                pieces = []
            for dst, src, n in pieces:
                _move(dst, src, n)
            if self._shared is not None:
                self._join(self._shared)
        finally:
            self._shared = None
            self._expect = 0
            self._keep.clear()
            self.nbytes = 0

    def cancel(self) -> None:
        """Copy nothing more; returns once no helper is copying (a failed stage)."""
        shared, self._shared = self._shared, None
        self._expect = 0
        if shared is not None:
            shared.close()
        self._pieces = []
        self._keep.clear()
        self.nbytes = 0

    def _join(self, shared: _Runs) -> None:
        shared.seal()
        try:
            shared.work()
        finally:
            shared.close()


class _Runs:
    """Runs handed out one at a time as they are added; :meth:`close` stops handing out and
    waits for those taken. Until :meth:`seal`, a thread that finds none waits for more."""

    def __init__(self) -> None:
        self._runs: list[tuple[int, int, int]] = []
        self._next = 0
        self._busy = 0
        self._waiting = 0
        self._sealed = False
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    def add(self, runs: list[tuple[int, int, int]]) -> None:
        with self._cond:
            self._runs += runs
            if self._waiting:
                self._cond.notify_all()

    def seal(self) -> None:
        """No more runs: a thread that finds none returns."""
        with self._cond:
            self._sealed = True
            self._cond.notify_all()

    def _take(self) -> tuple[int, int, int] | None:
        with self._cond:
            while not self._closed:
                if self._next < len(self._runs):
                    run = self._runs[self._next]
                    self._next += 1
                    self._busy += 1
                    return run
                if self._sealed:
                    break
                self._waiting += 1
                self._cond.wait()
                self._waiting -= 1
            return None

    def work(self) -> None:
        while (run := self._take()) is not None:
            try:
                _move(*run)
            finally:
                with self._cond:
                    self._busy -= 1
                    if not self._busy:
                        self._cond.notify_all()

    def close(self) -> None:
        """Hand out no more runs, and wait for those under way."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()  # helpers waiting for runs return
            while self._busy:
                self._cond.wait()


class _Cores:
    """Where the helpers of one copy may run: the process's cores less the one the trainer's
    thread is on (see the module docstring). Best effort: where the platform has no affinity
    calls, or refuses one, the helpers run wherever the scheduler puts them."""

    def __init__(self, allowed: set[int], away: set[int]) -> None:
        self._allowed = allowed
        self._away = away

    @classmethod
    def now(cls) -> _Cores:
        if _sched_getcpu is None or not hasattr(os, "sched_getaffinity"):
            return cls(set(), set())
        try:
            allowed = os.sched_getaffinity(0)  # this thread's: the trainer's
        except OSError:
            return cls(set(), set())
        cpu = _sched_getcpu()
        away = allowed - {cpu}
        return cls(allowed, away if cpu in allowed and away else set())

    def keep_off(self, tid: int) -> None:
        self._set(tid, self._away)

    def release(self, tid: int) -> None:
        self._set(tid, self._allowed if self._away else set())

    @staticmethod
    def _set(tid: int, cpus: set[int]) -> None:
        """``tid`` 0: the calling thread."""
        if not cpus:
            return
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError as e:  # e.g. a cpuset that changed under us: the mask stays as it was
            logger.debug("could not set a staging helper's cores to %s: %s", sorted(cpus), e)


def _getcpu() -> Callable[[], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn


_sched_getcpu = _getcpu()


class _Helper:
    """One staging helper thread, with its kernel thread id (for its affinity mask)."""

    def __init__(self, name: str) -> None:
        self._tasks: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        self.tid = 0
        started = threading.Event()
        # A daemon thread: the interpreter's exit does not wait for it, and it is never in the
        # middle of a copy then (run() returns only when every run taken is done).
        self._thread = threading.Thread(target=self._loop, args=(started,), name=name, daemon=True)
        self._thread.start()
        started.wait()

    def _loop(self, started: threading.Event) -> None:
        self.tid = threading.get_native_id()
        started.set()
        while True:
            fn, fut = self._tasks.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # reported through the future, as an executor does
                fut.set_exception(e)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        fut: Future[Any] = Future()
        self._tasks.put((fn, fut))
        return fut


_HELPERS: list[_Helper] = []
_HELPERS_LOCK = threading.Lock()


def helpers() -> int:
    """Helper threads: with the trainer's thread, one per core (at most 16)."""
    return max(1, min(15, (os.cpu_count() or 2) - 1))


def _helpers(n: int) -> list[_Helper]:
    """The first ``n`` helpers, started on first use."""
    with _HELPERS_LOCK:
        while len(_HELPERS) < n:
            _HELPERS.append(_Helper(f"tierckpt-stage_{len(_HELPERS)}"))
        return _HELPERS[:n]


def _forget_helpers() -> None:
    global _HELPERS, _HELPERS_LOCK
    # A forked child has none of the parent's threads, and the lock may have been held by one.
    _HELPERS, _HELPERS_LOCK = [], threading.Lock()


os.register_at_fork(after_in_child=_forget_helpers)
