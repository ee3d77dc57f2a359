"""What verifying a restore from memory costs, and what hashing while copying wins back (issue 24,
goal 1).

A restore from this node's memory copies each tensor out of the tier file's mapping (tmpfs) into
the trainer's touched tensor and checks every block against the checksum taken when it was
written. Measured here, interleaved and repeated (medians and bests), all into the same touched
destination:

- ``memcpy``: torch's ``copy_`` of the whole source (the unverified restore's copy; torch splits
  it over its intra-op threads) and numpy's ``copyto`` (one thread);
- ``hash``: xxh3-128 (the block checksum) and xxh3-64 of the source alone, one thread, and
  xxh3-128 over two threads on two halves (does xxhash release the GIL?);
- ``copy, then hash``: the two passes a restore made before;
- ``fused``: :func:`tierckpt_core.verified_copy.copy_verified`, each piece hashed in the destination
  right after it was copied, at several piece sizes, on one thread and split over as many threads
  as torch's copy uses (``--threads``).

Run: ``python bench/verified_copy.py [--size-mb 1024] [--reps 7] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from harness import Row, child_results, yes

from tierckpt_core.integrity import checksum_blocks
from tierckpt_core.verified import BlockSums
from tierckpt_core.verified_copy import copy_verified


def _source(size: int) -> tuple[mmap.mmap, BlockSums, Any]:
    """A tier-like file of ``size`` random bytes in /dev/shm, mapped and touched, with its block
    checksums."""
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
        os.unlink(path)
    arr = np.frombuffer(m, np.uint8)
    rng = np.random.default_rng(0)
    step = 64 << 20
    for at in range(0, size, step):
        n = min(step, size - at)
        arr[at : at + n] = rng.integers(0, 256, n, dtype=np.uint8)
    _, bsize, blocks = checksum_blocks(memoryview(m))
    return m, BlockSums("r0.data", size, bsize, blocks, "bench", "in this node's memory"), arr


def _hash_two_threads(view: memoryview) -> None:
    half = len(view) // 2
    threads = [
        threading.Thread(target=lambda a=a: xxhash.xxh3_128(view[a : a + half]).digest())
        for a in (0, half)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """The suite's run: 1 GiB (64 MiB, 2 repetitions in smoke mode)."""
    out = tmp / "verified_copy.json"
    cmd = ["--json", str(out)] + (["--size-mb", "64", "--reps", "2"] if args.smoke else [])
    what = "verified copy out of memory vs memcpy"
    d = child_results("verified_copy.py", cmd, out, what, notes, "verified copy")
    return None if d is None else dict(d)


def rows(res: dict[str, Any]) -> list[Row]:
    """Issue 24 goal 1: the verified copy out of memory (hash while copying) >= 0.9x memcpy."""
    v = res.get("verified_copy")
    if not v:
        return []
    size = f"{v['size'] >> 20} MiB"
    by = {r["case"]: r for r in v["rows"]}
    memcpy = by["memcpy (torch copy_)"]
    fused = [r for r in v["rows"] if r["case"].startswith("fused")]
    best = max(fused, key=lambda r: r["vs_memcpy"])
    two_pass = by["copy, then hash (two passes)"]
    out: list[Row] = []
    for label, r in [
        ("memcpy out of the tier mapping (torch copy_)", memcpy),
        ("verification alone: xxh3-128, 1 thread", by["hash xxh3_128 (1 thread)"]),
        ("verified: copy, then hash (two passes)", two_pass),
        (f"verified: hash while copying ({best['case'][7:]})", best),
    ]:
        met = r is best
        out.append(
            (
                size,
                label,
                f"{v['size'] / r['median_gbps'] / 1e6:.0f} ms",
                f"{r['median_gbps']:.1f}",
                f"{r['vs_memcpy']:.2f}x memcpy" if r in (best, two_pass) else "",
                ">= 0.9" if met else "",
                yes(r["vs_memcpy"] >= 0.9) if met else "",
            )
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--chunks-kb", default="64,256,1024,4096")
    p.add_argument(
        "--threads",
        default="",
        help="thread counts of the split fused copy (default: torch's intra-op threads, which "
        "its copy_ uses)",
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    size = args.size_mb << 20
    m, sums, src_arr = _source(size)
    src_view = memoryview(m)
    src_t = torch.from_numpy(src_arr)
    dest = torch.empty(size, dtype=torch.uint8)
    dest.fill_(1)  # touched, as a trainer's tensors are
    dest_np = dest.numpy()
    dest_view = memoryview(dest_np)
    chunks = [int(c) << 10 for c in args.chunks_kb.split(",")]
    threads = [int(t) for t in args.threads.split(",") if t] or [torch.get_num_threads()]

    def two_pass() -> None:
        dest.copy_(src_t)
        xxhash.xxh3_128(dest_view).digest()

    cases: dict[str, Callable[[], Any]] = {
        "memcpy (torch copy_)": lambda: dest.copy_(src_t),
        "memcpy (numpy copyto, 1 thread)": lambda: np.copyto(dest_np, src_arr),
        "hash xxh3_128 (1 thread)": lambda: xxhash.xxh3_128(src_view).digest(),
        "hash xxh3_64 (1 thread)": lambda: xxhash.xxh3_64(src_view).digest(),
        "hash xxh3_128 (2 threads)": lambda: _hash_two_threads(src_view),
        "copy, then hash (two passes)": two_pass,
    }
    for c in chunks:
        cases[f"fused, {c >> 10} KiB pieces"] = lambda c=c: copy_verified(
            src_view, dest_view, sums, 0, chunk=c
        )
    for t in threads:
        for c in [256 << 10, 512 << 10, 1 << 20, 2 << 20]:
            cases[f"fused, {c >> 10} KiB pieces, {t} threads"] = lambda t=t, c=c: copy_verified(
                src_view, dest_view, sums, 0, chunk=c, threads=t
            )
    times: dict[str, list[float]] = {k: [] for k in cases}
    for fn in cases.values():  # warm up: pages, pools, caches
        fn()
    for _ in range(args.reps):  # interleaved: a noisy neighbour slows every case alike
        for name, fn in cases.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    assert torch.equal(dest, src_t)
    base = statistics.median(times["memcpy (torch copy_)"])
    rows = []
    print(
        f"{args.size_mb} MiB, blocks of {sums.size >> 10} KiB, {os.cpu_count()} cores, "
        f"torch threads {torch.get_num_threads()}, {args.reps} interleaved reps"
    )
    print(f"{'case':44} {'median GB/s':>11} {'best GB/s':>10} {'x memcpy':>9}")
    for name, ts in times.items():
        med, best = statistics.median(ts), min(ts)
        row = {
            "case": name,
            "median_gbps": size / med / 1e9,
            "best_gbps": size / best / 1e9,
            "vs_memcpy": base / med,
            "s": ts,
        }
        rows.append(row)
        print(f"{name:44} {row['median_gbps']:11.2f} {row['best_gbps']:10.2f} {base / med:9.2f}")
    if args.json:
        args.json.write_text(json.dumps({"size": size, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
