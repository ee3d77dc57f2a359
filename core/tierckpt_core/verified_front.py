"""Blocks checked in order over several threads, and the caller told how far the checked front
has come: a copy that reads the bytes after they are checked (a DMA to a device,
``tierckpt_client.dcp._device_copy``) follows the front instead of running beside the checks.

Why a front and not one check of everything first: the copy then starts after the first few
blocks, not after all of them, and it reads each block while the check has just brought it
into the processor's cache rather than from memory a second time beside the check (on a GPU
host a DMA beside 15 hashing threads ran ~15 % below the link: docs/benchmarks.md).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

from tierckpt_core.verified import BlockSums, _bytes
from tierckpt_core.verified_copy import Spawn

STEP = 8 << 20
"""Bytes of checked blocks the front gains before the caller is told (and at the end)."""

WAIT_S = 0.5
"""How long the caller waits at a time for the front to move before it looks at the workers
(one that stopped without a word is never waited for)."""


def check_in_order(
    blocks: Sequence[tuple[Any, BlockSums, int]],
    *,
    threads: int,
    spawn: Spawn,
    ready: Callable[[int], None],
    step: int | None = None,
) -> int:
    """Check each ``(src, sums, block)`` as :func:`~tierckpt_core.verified_copy.check_all`
    does, on ``threads`` workers started with ``spawn``, taking the blocks in the order given;
    on the caller's thread, ``ready(k)`` whenever the first ``k`` blocks are all checked (``k``
    grown by at least ``step`` bytes, default :data:`STEP`, since the last call, or all of them). ``ready`` is never
    told of a block not checked, nor of any block after a bad one. Every worker that started is
    waited for. The bytes checked; BlockMismatchError (a bad block), or what ``ready`` raised."""
    n = len(blocks)
    if not n:
        return 0
    step = STEP if step is None else step
    jobs = [(_bytes(src), sums, b, *sums.bounds(b)) for src, sums, b in blocks]
    done = bytearray(n)
    cv = threading.Condition()
    failed = threading.Event()
    todo = iter(range(n))
    take = threading.Lock()
    want = [0]  # the block the caller waits for: only its check wakes the caller

    def work() -> int:
        checked = 0
        while not failed.is_set():
            with take:
                i = next(todo, None)
            if i is None:
                break
            view, sums, b, lo, hi = jobs[i]
            try:
                if (
                    xxhash.xxh3_128_hexdigest(view[lo - sums.origin : hi - sums.origin])
                    != (sums.digests[b])
                ):
                    raise sums.mismatch(b)
            except BaseException:
                failed.set()
                with cv:
                    cv.notify()
                raise
            checked += hi - lo
            with cv:
                done[i] = 1
                if i == want[0]:
                    cv.notify()
        return checked

    futures = list(spawn(max(1, threads), work))
    front = gained = 0
    mine = 0
    try:
        while front < n:
            with cv:
                want[0] = front
                while not done[front] and not failed.is_set():
                    if all(f.done() for f in futures):
                        break  # none left working (none started, or all stopped): see below
                    cv.wait(WAIT_S)
            if failed.is_set():
                break
            if not done[front]:
                mine += work()  # no worker left: the caller checks the rest itself
                continue
            while front < n and done[front]:
                gained += jobs[front][4] - jobs[front][3]
                front += 1
            if gained >= step or front == n:
                ready(front)
                gained = 0
    except BaseException:
        failed.set()  # the workers stop at their next block
        raise
    finally:
        running = [f for f in futures if not f.cancel()]
        concurrent.futures.wait(running)
    return mine + sum(f.result() for f in running)  # a bad block's error
