"""Staging's copy of CPU tensors into the tier file: raw bytes in runs, shared by the trainer's
thread and a few helper threads, waiting only for the runs under way.

torch's ``copy_`` splits each tensor over its OpenMP threads and waits at a barrier for all of
them, per tensor. On a busy machine a thread the scheduler holds back holds the whole copy (tens
of times its quiet time: docs/benchmarks.md, "Figures behind the code's choices"), and the stall
of ``async_save`` is that copy. Here the bytes of all the tensors are cut into runs of
:data:`RUN` bytes that the trainer's thread and the helpers' take in turn (the copy releases the
GIL): a helper that has not started when the trainer's thread runs out of
runs does none, so the copy waits only for runs that are under way, never for a thread that was
not scheduled. Only the plain case goes this way (a contiguous CPU source without conjugate or
negative bit: the same bytes ``copy_`` would write); everything else is ``copy_``.

Where the helpers run: :mod:`tierckpt_client.dcp._helpers`.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from tierckpt_client.dcp._helpers import STAGE, on_helpers
from tierckpt_client.dcp._metadata_codec import NUMPY_DTYPES
from tierckpt_core.threads import copy_bytes

RUN = 4 << 20
"""Bytes one thread copies at a time: handing a run over costs a few microseconds."""

SPLIT_MIN = 2 * RUN
"""Below this many bytes in all, the trainer's thread copies alone."""

SMALL_NUMEL = 32768
"""Tensors of fewer elements are copied by torch, a run of them in one call (``_foreach_copy_``:
a loop in C++ with the GIL released, ~5 us a tensor less than a call from Python each: 2048
tensors of 32 KiB took 16 ms on one thread of the 2-core box against 22 ms); torch copies a
tensor this small on the calling thread (its parallel grain), never on its OpenMP workers."""

_FOREACH = getattr(torch, "_foreach_copy_", None)

_MOVED_AS_IS = (NUMPY_DTYPES - {torch.bool}) | {torch.bfloat16}
"""dtypes whose every bit pattern torch's same-dtype ``copy_`` writes as it is (NaN payloads
included; tested with random bytes). Not ``bool``: ``copy_`` writes a byte other than 0 or 1 as
1, and staging keeps every byte as it was."""

HELPER_RUNS = 2
"""Runs of the copy per helper woken: a helper woken for a single run cost more than it saved
(a 64 MiB stage on a quiet 16-core host: 6.6 ms with 15 helpers, 3.3 ms with 7)."""


def _move(dst: int, src: int, n: int) -> None:
    """Copy ``n`` bytes from address ``src`` to address ``dst`` (not overlapping), the GIL
    released (:func:`tierckpt_core.threads.copy_bytes`: a vectorised loop, faster than
    libc's ``memmove`` here)."""
    copy_bytes((ctypes.c_uint8 * n).from_address(dst), (ctypes.c_uint8 * n).from_address(src))


def plain(src: torch.Tensor) -> bool:
    """Whether copying ``src`` into a contiguous host tensor of its dtype and shape is a copy of
    its bytes as they are (``src`` in host memory)."""
    return src.is_contiguous() and not src.is_conj() and not src.is_neg()


class ByteCopies:
    """Copies of whole byte ranges, gathered and then run together by :meth:`run`: made with
    ``threads > 1`` and at least :data:`SPLIT_MIN` bytes gathered, :meth:`run` wakes one helper
    for every :data:`HELPER_RUNS` runs (at most ``threads - 1``) and copies beside them.

    The helpers are woken once the layout is done, not at the first :meth:`add`: started early
    they took the GIL between their runs while the trainer's thread was laying out the next
    tensors, and a 64 MiB stage over 16 threads took 8.7 ms instead of 6.6 (docs/benchmarks.md,
    "The GIL-free block hash and the 64 MiB stall, measured on a quiet host")."""

    def __init__(self, threads: int = 1) -> None:
        self._pieces: list[tuple[int, int, int]] = []  # (dst address, src address, bytes)
        self._small: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (dst, src, bytes)
        self.nbytes = 0
        self._keep: list[torch.Tensor] = []  # the sources stay alive until the copy is done
        self._threads = threads

    def add(self, dst: int, src: torch.Tensor, n: int, view: torch.Tensor | None = None) -> None:
        """Copy the ``n`` bytes of ``src`` (:func:`plain`) to address ``dst`` by the end of
        :meth:`run`; ``view``: a tensor of ``src``'s dtype and shape over those bytes (a small
        ``src`` is then copied by torch, :data:`SMALL_NUMEL`)."""
        if not n:
            return
        self._keep.append(src)
        self.nbytes += n
        if (
            view is not None
            and _FOREACH is not None
            and src.numel() < SMALL_NUMEL
            and src.dtype in _MOVED_AS_IS
        ):
            self._small.append((view, src, n))
        else:
            self._pieces.append((dst, src.data_ptr(), n))

    def run(self, threads: int | None = None) -> None:
        """Every copy, on up to ``threads`` threads (default: as made; this one and helpers);
        returns when all the bytes are in place, and no thread writes into a destination after
        that."""
        threads = self._threads if threads is None else threads
        pieces, self._pieces = self._pieces, []
        small, self._small = self._small, []
        try:
            helpers = min(threads - 1, -(-self.nbytes // (HELPER_RUNS * RUN)) - 1)
            if helpers > 0 and self.nbytes >= SPLIT_MIN:
                shared = _Runs()
                shared.add([*runs_of(pieces), *small_runs(small)])
                on_helpers(STAGE, helpers, shared.work)
                self._join(shared)
            else:
                for run in small_runs(small):
                    _copy_run(run)
                for dst, src, n in pieces:
                    _move(dst, src, n)
        finally:
            self._keep.clear()
            self.nbytes = 0

    def cancel(self) -> None:
        """Copy nothing gathered (a failed stage): no helper runs before :meth:`run`."""
        self._pieces = []
        self._small = []
        self._keep.clear()
        self.nbytes = 0

    def _join(self, shared: _Runs) -> None:
        shared.seal()
        try:
            shared.work()
        finally:
            shared.close()


Piece = tuple[int, int, int]  # (dst, src, n): n bytes from address src to address dst
Pairs = tuple[list[torch.Tensor], list[torch.Tensor]]  # small tensors: (destinations, sources)
Run = list[Piece] | Pairs


def small_runs(small: list[tuple[torch.Tensor, torch.Tensor, int]]) -> list[Run]:
    """Small tensors ``(dst, src, bytes)`` in runs of about :data:`RUN` bytes, each copied by
    one ``_foreach_copy_``."""
    runs: list[Run] = []
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    size = 0
    for dst, src, n in small:
        dsts.append(dst)
        srcs.append(src)
        size += n
        if size >= RUN:
            runs.append((dsts, srcs))
            dsts, srcs, size = [], [], 0
    if dsts:
        runs.append((dsts, srcs))
    return runs


def _copy_run(run: Run) -> None:
    if isinstance(run, tuple):
        assert _FOREACH is not None
        # In inference mode whatever the caller's: the tier file's tensors may have been made
        # in it (a save from inside torch.inference_mode()), and torch refuses an in-place
        # update of those outside it (the byte copy never asked).
        with torch.inference_mode():
            _FOREACH(run[0], run[1])
        return
    for piece in run:
        _move(*piece)


def runs_of(pieces: list[Piece]) -> list[list[Piece]]:
    """The pieces in runs of about :data:`RUN` bytes: a large piece cut into runs of its own,
    small ones (tensors of a few KiB) side by side in one run. One run per small tensor made
    each a hand-over: 2048 tensors of 32 KiB copied slower over two threads than over one."""
    runs: list[list[Piece]] = []
    group: list[Piece] = []
    size = 0
    for dst, src, n in pieces:
        if n >= RUN:
            runs += [[(dst + at, src + at, min(RUN, n - at))] for at in range(0, n, RUN)]
            continue
        group.append((dst, src, n))
        size += n
        if size >= RUN:
            runs.append(group)
            group, size = [], 0
    if group:
        runs.append(group)
    return runs


class _Runs:
    """Runs handed out one at a time as they are added; :meth:`close` stops handing out and
    waits for those taken. Until :meth:`seal`, a thread that finds none waits for more."""

    def __init__(self) -> None:
        self._runs: list[Run] = []
        self._next = 0
        self._busy = 0
        self._waiting = 0
        self._sealed = False
        self._closed = False
        self._cond = threading.Condition(threading.Lock())

    def add(self, runs: list[Run]) -> None:
        with self._cond:
            self._runs += runs
            if self._waiting:
                self._cond.notify_all()

    def seal(self) -> None:
        """No more runs: a thread that finds none returns."""
        with self._cond:
            self._sealed = True
            self._cond.notify_all()

    def _take(self) -> Run | None:
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
                _copy_run(run)
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
