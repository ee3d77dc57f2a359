"""Work shared over threads, for the checked copies and checks of :mod:`tierckpt_core.verified_copy`
and the client's staging: runs of work handed to the caller's thread and others (a pool of this
module's, or the client's helpers), and a byte copy that releases the GIL, so that such work runs
on several cores at once."""

from __future__ import annotations

import concurrent.futures
import ctypes
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

_R = TypeVar("_R")  # one run of work that share hands a worker


def share(runs: Sequence[_R], workers: int, do: Callable[[_R], int], spawn: Spawn | None) -> int:
    """``do`` every run, on the caller's thread and ``workers - 1`` others, each taking the next
    run until none is left; the sum of what ``do`` returned. The first error stops the others at
    their next run and is raised. Every worker that started is waited for (it may still write
    into a destination); one that has not started when the caller's thread is done finds no run
    left: cancelled, it is not waited for."""
    todo = iter(runs)
    lock = threading.Lock()
    failed = threading.Event()

    def work() -> int:
        done = 0
        while not failed.is_set():
            with lock:
                run = next(todo, None)
            if run is None:
                break
            try:
                done += do(run)
            except BaseException:
                failed.set()  # the others stop at their next run
                raise
        return done

    if workers <= 1:
        return work()
    futures = (spawn or _on_pool)(workers - 1, work)
    checked = 0
    try:
        checked = work()
    finally:
        running = [f for f in futures if not f.cancel()]
        concurrent.futures.wait(running)
    return checked + sum(f.result() for f in running)  # a bad block's error


Spawn = Callable[[int, Callable[[], int]], Sequence["concurrent.futures.Future[int]"]]
"""``spawn(n, work)``: ``work`` started on ``n`` other threads, a future for each."""


def _on_pool(n: int, work: Callable[[], _R]) -> list[concurrent.futures.Future[_R]]:
    return [pool().submit(work) for _ in range(n)]


_POOL: concurrent.futures.ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def pool() -> concurrent.futures.ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = concurrent.futures.ThreadPoolExecutor(
                min(16, os.cpu_count() or 1), thread_name_prefix="tierckpt-verify"
            )
        return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    # A forked child has none of the parent's threads, and the lock may have been held by one.
    _POOL, _POOL_LOCK = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


memmove = ctypes.memmove  # (a foreign call: the GIL released while it copies)


def _copier() -> Callable[[Any, Any], None]:
    """``copy(dest, src)`` of two equal byte buffers: numpy's, which releases the GIL (so copies
    in several threads run at once), where numpy is installed (the client); else Python's.

    numpy's ``positive`` of unsigned bytes (the identity: every byte as it is) and not its
    ``copyto``: ``copyto`` calls libc's ``memmove``, and ``positive`` runs numpy's vectorised
    loop, the kind of loop torch's own ``copy_`` runs: it measured faster than glibc's
    ``memmove`` on one thread, most of all in small pieces, and shortened the ``async_save``
    stall's copy (docs/benchmarks.md, "Figures behind the code's choices")."""
    try:
        import numpy as np
    except ImportError:

        def assign(dest: Any, src: Any) -> None:
            memoryview(dest).cast("B")[:] = memoryview(src).cast("B")

        return assign

    u8 = np.uint8

    def positive(dest: Any, src: Any) -> None:
        np.positive(np.frombuffer(src, u8), out=np.frombuffer(dest, u8))

    return positive


_COPY: Callable[[Any, Any], None] | None = None


def copy_bytes(dest: Any, src: Any) -> None:
    """Copy the bytes of buffer ``src`` into buffer ``dest``, of the same length (contiguous,
    not overlapping); releases the GIL where numpy is installed (:func:`_copier`)."""
    global _COPY
    if _COPY is None:  # numpy is imported on the first copy, not with the daemon
        _COPY = _copier()
    _COPY(dest, src)
