"""Block verification over 1 and 2 threads: xxhash's own call against the same hash through ctypes
(``_nogil_hash`` here), which releases the GIL for blocks of 64 KiB and less.

The state is ``--size-mb`` (default 1024) of bytes in files of ``--file-mb`` (default 64: the
largest file whose blocks are 64 KiB, which xxhash hashes holding the GIL), in memory (not in the
cache: what a restore's verification reads). Every round, interleaved, medians over ``--iters``:

- ``hash only``: every block's digest compared with its checksum, the blocks split over 1 or 2
  threads, with xxhash's call and with the ctypes one: what scales and what does not;
- ``check_all``: ``verified_copy.check_all`` (a device restore's checks) as the code runs it
  (xxhash's call: one thread whatever is asked for blocks this small);
- ``copy_all``: ``verified_copy.copy_all`` (a CPU restore's verified copy) over 1 and 2 threads.

The ctypes hash is not in the product: this measured it slower over several threads than one
thread with xxhash's call. Ratios are to the same round's 1-thread xxhash time (or 1-thread
``copy_all``), so they hold on a loaded box.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import _nogil_hash as nogil_hash
import numpy as np
import xxhash

from tierckpt_core import verified_copy
from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.verified import BlockSums
from tierckpt_core.verified_copy import Copy, check_all, copy_all


def files(size_mb: int, file_mb: int) -> list[tuple[np.ndarray, BlockSums]]:
    out = []
    rng = np.random.default_rng(0)
    for i in range(size_mb // file_mb):
        data = rng.integers(0, 256, file_mb << 20, dtype=np.uint8)
        _, size, blocks = checksum_blocks(memoryview(data))
        out.append((data, BlockSums(f"f{i}", data.nbytes, size, blocks)))
    return out


def hash_only(fs: list[tuple[np.ndarray, BlockSums]], threads: int, nogil: bool) -> None:
    hex_at = nogil_hash.hexdigest_at()
    assert hex_at is not None
    work = [
        (data, nogil_hash.address(memoryview(data)), sums, b)
        for data, sums in fs
        for b in range(len(sums.digests))
    ]

    def part(k: int) -> None:
        for data, base, sums, b in work[k::threads]:
            lo, hi = sums.bounds(b)
            got = hex_at(base + lo, hi - lo) if nogil else xxhash.xxh3_128_hexdigest(data[lo:hi])
            if got != sums.digests[b]:
                raise AssertionError("mismatch")

    ts = [threading.Thread(target=part, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def held_share(f: tuple[np.ndarray, BlockSums], n: int = 2000) -> str:
    """What of a ctypes block check holds the GIL: the same call and comparison over 0 bytes,
    against the whole block, timed alternately (the rest runs beside other threads)."""
    hex_at = nogil_hash.hexdigest_at()
    assert hex_at is not None
    data, sums = f
    base = nogil_hash.address(memoryview(data))
    assert base is not None
    held, whole = [], []
    for _ in range(5):
        for size, out in ((0, held), (sums.size, whole)):
            t0 = time.perf_counter()
            for b in range(n):
                hex_at(base + (b % 1024) * sums.size, size) == sums.digests[b % 1024]  # noqa: B015
            out.append((time.perf_counter() - t0) / n)
    h, w = statistics.median(held), statistics.median(whole)
    return (
        f"ctypes block check: {w * 1e6:.2f} us a {sums.size >> 10} KiB block, of which "
        f"{h * 1e6:.2f} us hold the GIL ({h / w:.0%}; xxhash's own call holds it 100%): "
        f"2 threads at most {w / max(h, w / 2):.2f}x one"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--file-mb", type=int, default=64)
    p.add_argument("--iters", type=int, default=7)
    args = p.parse_args()
    assert verified_copy.GIL_HELD_MAX >= 65536
    fs = files(args.size_mb, args.file_mb)
    print(f"{len(fs)} files of {args.file_mb} MiB, blocks of {fs[0][1].size >> 10} KiB")
    blocks = [(data, sums, b) for data, sums in fs for b in range(len(sums.digests))]
    dests = [np.empty_like(data) for data, _ in fs]
    for d in dests:
        d.fill(1)  # touched
    copies = [Copy(dest, sums, 0, src=data) for dest, (data, sums) in zip(dests, fs, strict=True)]

    cases: dict[str, Callable[[], Any]] = {
        "hash only, xxhash's call, 1 thread": lambda: hash_only(fs, 1, False),
        "hash only, xxhash's call, 2 threads": lambda: hash_only(fs, 2, False),
        "hash only, ctypes (nogil_hash), 1 thread": lambda: hash_only(fs, 1, True),
        "hash only, ctypes (nogil_hash), 2 threads": lambda: hash_only(fs, 2, True),
        "check_all, 2 threads asked": lambda: check_all(blocks, threads=2),
        "copy_all, 1 thread": lambda: copy_all(copies, threads=1),
        "copy_all, 2 threads": lambda: copy_all(copies, threads=2),
    }
    times: dict[str, list[float]] = {k: [] for k in cases}
    cores: dict[str, list[float]] = {k: [] for k in cases}
    ratios: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(args.iters):
        this: dict[str, float] = {}
        for name, fn in cases.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            this[name] = time.perf_counter() - t0
            times[name].append(this[name])
            cores[name].append((time.process_time() - c0) / this[name])
        for name in cases:
            ref = (
                "hash only, xxhash's call, 1 thread"
                if name.startswith(("hash", "check_all"))
                else "copy_all, 1 thread"
            )
            ratios[name].append(this[ref] / this[name])
    print(held_share(fs[0]))
    print(
        f"\n| {args.size_mb} MiB | median ms | GB/s | speed over the reference, same round "
        "| cores busy (CPU s / wall s) |"
    )
    print("|---|---:|---:|---:|---:|")
    for name in cases:
        med = statistics.median(times[name])
        print(
            f"| {name} | {med * 1e3:.1f} | {args.size_mb * (1 << 20) / med / 1e9:.1f} "
            f"| {statistics.median(ratios[name]):.2f}x | {statistics.median(cores[name]):.2f} |"
        )


if __name__ == "__main__":
    main()
