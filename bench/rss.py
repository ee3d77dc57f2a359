"""The trainer's extra resident memory during a tierckpt ``async_save`` vs. torch's default one.

One process saves the same state ``--iters`` times with each (tierckpt first: torch's freed copy
may stay in this process's heap), and records its RSS parts from /proc/self/status before the
call, when it returns and when the save is done, and the peak (VmHWM, reset before each save).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from harness import EXTRA, Row, child_results, make_state, mutate, running_daemon, yes
from torch.distributed.checkpoint import FileSystemWriter

from tierckpt_client.dcp import TieredStorageWriter

RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")
CAPACITY_MB = 3 * 4096 + 1024  # keep_last 2 + 1 steps of up to 4 GiB, and slack


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="state size (MiB)")
    p.add_argument("--iters", type=int, default=2, help="saves with each (the last one counts)")
    p.add_argument("--out", type=Path, default=Path("bench/results/rss.json"))
    return p.parse_args()


def proc_status() -> dict[str, float]:
    """This process's resident memory from /proc/self/status, in MiB (VmHWM: the peak)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in (*RSS_FIELDS, "VmHWM"):
            out[key] = int(rest.split()[0]) / 1024
    return out


def reset_peak_rss() -> None:
    with contextlib.suppress(OSError):  # kernels without it keep the lifetime peak
        Path("/proc/self/clear_refs").write_text("5")


def measure(size_mb: int, iters: int) -> dict[str, Any]:
    fs_root = Path(f"/dev/shm/tierckpt-bench-rss-{uuid.uuid4().hex[:8]}")
    sd = make_state(size_mb, extra=EXTRA)

    def rounds(make_writer: Callable[[int], Any]) -> list[dict[str, Any]]:
        runs = []
        for i in range(iters):
            mutate(sd)
            gc.collect()
            reset_peak_rss()
            before = proc_status()
            fut = dcp.async_save(sd, storage_writer=make_writer(i), no_dist=True)
            returned = proc_status()
            fut.result()
            done = proc_status()
            del fut
            runs.append(
                {
                    "returned": {k: returned[k] - before[k] for k in RSS_FIELDS},
                    "done": {k: done[k] - before[k] for k in RSS_FIELDS},
                    "peak_rss": done["VmHWM"] - before["VmRSS"],
                }
            )
        return runs

    def fs_writer(i: int) -> FileSystemWriter:
        shutil.rmtree(fs_root / f"step_{i - 1}", ignore_errors=True)
        return FileSystemWriter(fs_root / f"step_{i}")

    try:
        with running_daemon(CAPACITY_MB):
            return {
                "tierckpt": rounds(lambda i: TieredStorageWriter("rss", step=i + 1)),
                "torch_default": rounds(fs_writer),
            }
    finally:
        shutil.rmtree(fs_root, ignore_errors=True)


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any]:
    """The suite's run: ``--rss-mb``, 2 saves each; a failure fails the suite."""
    what = f"trainer RSS during async_save, {args.rss_mb} MiB"
    cmd = ["--size-mb", str(args.rss_mb)]
    got = child_results("rss.py", cmd, tmp / "rss.json", what, notes, required=True)
    return {"size_mb": args.rss_mb, **(got or {})}


def rows(res: dict[str, Any]) -> list[Row]:
    if "rss" not in res:
        return []
    rss = res["rss"]
    size = rss["size_mb"]
    out: list[Row] = []
    last = {k: rss[k][-1] for k in ("tierckpt", "torch_default")}  # steady: the last save
    for key, label in (("tierckpt", "tierckpt"), ("torch_default", "torch default")):
        r = last[key]
        v = (
            f"anon +{r['returned']['RssAnon']:.0f} / shmem +{r['returned']['RssShmem']:.0f} MiB "
            f"at return; anon +{r['done']['RssAnon']:.0f} / shmem +{r['done']['RssShmem']:.0f} "
            f"when done; peak RSS +{r['peak_rss']:.0f}"
        )
        ratio, target, met = "", "", ""
        if key == "tierckpt":
            anon = max(r["returned"]["RssAnon"], r["done"]["RssAnon"])
            torch_anon = last["torch_default"]["returned"]["RssAnon"]
            ratio = f"{anon / torch_anon:.3f}x torch" if torch_anon > 0 else ""
            target, met = "~0 (<= 2% of state)", yes(anon <= 0.02 * size)
        out.append(
            (f"{size} MiB", f"trainer extra RSS, {label} async_save", v, "", ratio, target, met)
        )
    return out


def main() -> None:
    args = parse_args()
    res = measure(args.size_mb, args.iters)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res))
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
