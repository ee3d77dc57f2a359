"""Staging's copy of CPU tensors into the tier file: raw bytes in runs, shared by the trainer's
thread and a few pool threads, waiting only for the runs under way.

torch's ``copy_`` splits each tensor over its OpenMP threads and waits at a barrier for all of
them, per tensor. On a busy machine a thread the scheduler holds back holds the whole copy: on
the shared 2-core box a 64 MiB copy that takes 3 ms quiet took 100-200 ms in such rounds, and
the stall of ``async_save`` is that copy. Here the bytes of all the tensors are cut into runs of
:data:`RUN` bytes that the trainer's thread and the pool's take in turn (``memmove`` through
ctypes releases the GIL): a helper that has not started when the trainer's thread runs out of
runs does none, so the copy waits only for runs that are under way, never for a thread that was
not scheduled. Only the plain case goes this way (a contiguous CPU source without conjugate or
negative bit: the same bytes ``copy_`` would write); everything else is ``copy_``.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading

import torch

RUN = 4 << 20
"""Bytes one thread copies at a time: handing a run over costs a few microseconds."""

SPLIT_MIN = 2 * RUN
"""Below this many bytes in all, the trainer's thread copies alone."""


def plain(src: torch.Tensor) -> bool:
    """Whether copying ``src`` into a contiguous host tensor of its dtype and shape is a copy of
    its bytes as they are (``src`` in host memory)."""
    return src.is_contiguous() and not src.is_conj() and not src.is_neg()


class ByteCopies:
    """Copies of whole byte ranges, gathered and then run together by :meth:`run`."""

    def __init__(self) -> None:
        self._pieces: list[tuple[int, int, int]] = []  # (dst address, src address, bytes)
        self.nbytes = 0
        self._keep: list[torch.Tensor] = []  # the sources stay alive until the copy is done

    def add(self, dst: int, src: torch.Tensor, n: int) -> None:
        """Copy the ``n`` bytes of ``src`` (:func:`plain`) to address ``dst`` in :meth:`run`."""
        if n:
            self._pieces.append((dst, src.data_ptr(), n))
            self._keep.append(src)
            self.nbytes += n

    def run(self, threads: int) -> None:
        """Every copy, on up to ``threads`` threads (this one and the pool's); returns when all
        the bytes are in place, and no thread writes into a destination after that."""
        pieces, self._pieces = self._pieces, []
        try:
            if threads <= 1 or self.nbytes < SPLIT_MIN:
                for dst, src, n in pieces:
                    ctypes.memmove(dst, src, n)
                return
            runs = [
                (dst + at, src + at, min(RUN, n - at))
                for dst, src, n in pieces
                for at in range(0, n, RUN)
            ]
            shared = _Runs(runs)
            pool = _pool()
            for _ in range(min(threads - 1, len(runs) - 1, helpers())):
                pool.submit(shared.work)
            try:
                shared.work()
            finally:
                shared.close()
        finally:
            self._keep.clear()
            self.nbytes = 0


class _Runs:
    """Runs handed out one at a time; :meth:`close` stops handing out and waits for those
    taken."""

    def __init__(self, runs: list[tuple[int, int, int]]) -> None:
        self._runs = runs
        self._next = 0
        self._busy = 0
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    def _take(self) -> tuple[int, int, int] | None:
        with self._cond:
            if self._closed or self._next == len(self._runs):
                return None
            run = self._runs[self._next]
            self._next += 1
            self._busy += 1
            return run

    def work(self) -> None:
        while (run := self._take()) is not None:
            try:
                ctypes.memmove(*run)
            finally:
                with self._cond:
                    self._busy -= 1
                    if not self._busy:
                        self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._busy:
                self._cond.wait()


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def helpers() -> int:
    """Threads of the pool: with the trainer's thread, one per core (at most 16)."""
    return max(1, min(15, (os.cpu_count() or 2) - 1))


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                helpers(), thread_name_prefix="tierckpt-stage"
            )
        return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    # A forked child has none of the parent's threads, and the lock may have been held by one.
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)
