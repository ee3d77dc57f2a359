"""The client's copy helpers: threads that share a copy with the trainer's thread (staging's
byte copy, :mod:`tierckpt_client.dcp._byte_copy`; a restore's verified copy,
:func:`tierckpt_core.verified_copy.copy_all`), and where they run.

After any parallel torch op, the trainer's OpenMP workers spin for
several milliseconds (libgomp's default wait policy) waiting for the next one: a save right after
a training step finds the other cores taken by them. A woken helper then tends to land on the
trainer's own core (the only one the scheduler sees as no busier), and the two share it while the
spinning worker keeps its core: the copy then ran at one thread's speed with a helper, and a
helper often started milliseconds late. So each copy keeps its helpers off the
core the trainer's thread is on when they are woken (an affinity mask of the process's cores less
that one), and each helper lifts the mask as soon as it runs: from then on the scheduler may move
it anywhere, e.g. onto the core the trainer's thread leaves idle while it waits for a helper's
run. (A mask kept for the whole copy measured slower under load: a helper held on a busy core
could not be moved.)

Each kind of work has its own helpers (:data:`STAGE`, :data:`VERIFY`; :data:`CHECKSUM`, the whole
file's hash beside its blocks' when a save seals its file): a copy never waits for a helper busy
with work of another kind (a load in one thread while another stages).
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

STAGE = "stage"
VERIFY = "verify"
CHECKSUM = "checksum"


def on_helpers(kind: str, n: int, fn: Callable[[], T]) -> list[Future[T]]:
    """Run ``fn`` on up to ``n`` helpers of ``kind`` (at most :func:`helpers`), each woken
    off the calling thread's core and free to move as soon as it runs (module docstring). A
    future not yet running can be cancelled: its helper then skips ``fn``."""
    cores = _Cores.now()
    futures = []
    for h in _helpers(kind, max(0, min(n, helpers()))):
        cores.keep_off(h.tid)  # before it wakes

        def run() -> T:
            cores.release(0)  # running, off the caller's core: free to move from here on
            return fn()

        futures.append(h.submit(run))
    return futures


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
            logger.debug("could not set a helper's cores to %s: %s", sorted(cpus), e)


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
    """One helper thread, with its kernel thread id (for its affinity mask)."""

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


_HELPERS: dict[str, list[_Helper]] = {}
_HELPERS_LOCK = threading.Lock()


def helpers() -> int:
    """Helper threads of one kind: with the trainer's thread, one per core (at most 16)."""
    return max(1, min(15, (os.cpu_count() or 2) - 1))


def _helpers(kind: str, n: int) -> list[_Helper]:
    """The first ``n`` helpers of ``kind``, started on first use."""
    with _HELPERS_LOCK:
        mine = _HELPERS.setdefault(kind, [])
        while len(mine) < n:
            mine.append(_Helper(f"tierckpt-{kind}_{len(mine)}"))
        return mine[:n]


def _forget_helpers() -> None:
    global _HELPERS, _HELPERS_LOCK
    # A forked child has none of the parent's threads, and the lock may have been held by one.
    _HELPERS, _HELPERS_LOCK = {}, threading.Lock()


os.register_at_fork(after_in_child=_forget_helpers)


def quiet_openmp() -> None:
    """Let the calling thread's OpenMP workers go (``omp_pause_resource_all``, OpenMP 5.0), so
    that they do not spin on the cores a copy's helpers are about to take.

    After any parallel torch op, libgomp's workers spin for several milliseconds waiting for the
    next one (module docstring): a restore's verified copy right after one shared its helper's
    core with a spinning worker and took about 40 % longer (docs/benchmarks.md, "Figures behind
    the code's choices"). Paused, the workers leave; torch's next parallel op starts them again
    (a thread each). Only the calling thread's pool is affected, and
    only outside a parallel region. For the restore's copy only: a save every few steps would
    pay that restart on the trainer's next op each time. Best effort: a no-op where torch's
    runtime is not libgomp (:func:`_find_omp_pause`) or has no such call."""
    fn = _omp_pause()
    if fn is not None:
        fn(1)  # omp_pause_soft


_OMP_PAUSE: Any = None


def _omp_pause() -> Any:
    global _OMP_PAUSE
    if _OMP_PAUSE is None:
        _OMP_PAUSE = _find_omp_pause() or False
    return _OMP_PAUSE or None


def _find_omp_pause() -> Any:
    """``omp_pause_resource_all`` of the GNU OpenMP runtime already loaded into this process
    (torch's own libgomp on Linux), never one loaded anew. Only libgomp's: there it frees the
    calling thread's own pool and nothing else, and does nothing inside a parallel region;
    LLVM's and Intel's runtimes pause the whole runtime, which other threads of the trainer
    may be using (a data loader's)."""
    try:
        with open("/proc/self/maps") as f:
            fields = [line.split(maxsplit=5) for line in f]
    except OSError:
        return None
    paths = {x[5].strip() for x in fields if len(x) == 6 and x[5].startswith("/")}
    for path in sorted(paths):
        if not os.path.basename(path).startswith("libgomp"):
            continue
        try:
            # RTLD_NOLOAD: a handle to the library as loaded, or none (never a file read anew).
            lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
            fn = lib.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_int]
        fn.restype = ctypes.c_int
        return fn
    return None
