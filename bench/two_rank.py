"""A 2-rank (spawn + gloo) tierckpt save stall, each rank saving half of the state.

Each iteration both ranks copy their half (the paired memcpy, timed), then ``async_save`` it to
the one daemon; the stall and time-to-committed count as the slower rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import (
    EXTRA,
    Row,
    child_results,
    free_port,
    make_state,
    memcpy,
    mutate,
    running_daemon,
    tensors,
    yes,
)

from tierckpt_client.dcp import TieredStorageWriter

WARMUP = 3  # saves before the daemon recycles files (keep_last 2 + 1): the ramp-up
CAPACITY_MB = 3 * 4096 + 1024  # keep_last 2 + 1 steps of up to 4 GiB, and slack


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="total state of both ranks (MiB)")
    p.add_argument("--iters", type=int, default=10, help="saves")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between saves (untimed)")
    p.add_argument("--out", type=Path, default=Path("bench/results/two_rank.json"))
    return p.parse_args()


def _rank(
    rank: int, world: int, port: int, size_mb: int, iters: int, interval: float, out: str
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ckpt_group = dist.new_group(backend="gloo")
        half = make_state(size_mb // world, extra=EXTRA)
        sd: dict[str, Any] = {f"r{rank}.{k}": v for k, v in half.items() if k != "extra"}
        sd["extra"] = half["extra"]
        src = tensors(sd)
        dst = [t.clone() for t in src]  # pre-touched
        copies, blocking, committed = [], [], []
        for i in range(iters):
            if i:
                time.sleep(interval)
            mutate(sd)
            dist.barrier()  # both ranks copy at once, as they will when saving
            copies.append(memcpy(dst, src))  # the paired baseline
            dist.barrier()
            t0 = time.perf_counter()
            fut = dcp.async_save(
                sd,
                storage_writer=TieredStorageWriter("two-rank", step=i + 1),
                process_group=ckpt_group,
            )
            t1 = time.perf_counter()
            fut.result()
            t2 = time.perf_counter()
            blocking.append(t1 - t0)
            committed.append(t2 - t0)
        nbytes = sum(t.numel() * t.element_size() for t in src)
        mine = {"bytes": nbytes, "memcpy": copies, "blocking": blocking, "committed": committed}
        every: list[Any] = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            Path(out).write_text(json.dumps(every))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """The suite's run: ``--two-rank-mb`` in all; a note if it fails."""
    out = tmp / "two_rank.json"
    cmd = ["--size-mb", str(args.two_rank_mb), "--iters", str(args.iters)]
    cmd += ["--interval", str(args.interval)]
    what = f"2 ranks, {args.two_rank_mb} MiB in all"
    got = child_results("two_rank.py", cmd, out, what, notes, skipped="2-rank run")
    return None if got is None else {"size_mb": args.two_rank_mb, "ranks": got}


def rows(res: dict[str, Any]) -> list[Row]:
    """The slower rank's stall against the paired memcpy (and 1 rank's, if measured); adds the
    2-rank summary (``max_over_ranks_ms``, ``steady_ms``) to the results."""
    if "two_rank" not in res:
        return []
    tr, mem = res["two_rank"], res.get("memory_tier", {})
    size = tr["size_mb"]
    ranks = tr["ranks"]
    nbytes = sum(r["bytes"] for r in ranks)
    med = statistics.median
    keys = ("memcpy", "blocking", "committed")
    worst = {k: [max(x) for x in zip(*(r[k] for r in ranks), strict=True)] for k in keys}
    tr["max_over_ranks_ms"] = {k: [t * 1e3 for t in v] for k, v in worst.items()}
    warm = min(WARMUP, len(worst["blocking"]) - 1)
    steady = {k: med(v[warm:]) * 1e3 for k, v in worst.items()}
    paired = [b / m for b, m in zip(worst["blocking"], worst["memcpy"], strict=True)][warm:]
    tr["steady_ms"] = steady
    out: list[Row] = []

    def row(label: str, t_ms: float, ratio: str = "", target: str = "", met: str = "") -> None:
        gbps = nbytes / (t_ms / 1e3) / 1e9
        out.append((f"{size} MiB", label, f"{t_ms:.1f} ms", f"{gbps:.2f}", ratio, target, met))

    row("2 ranks: memcpy of each half right before each save, max over ranks", steady["memcpy"])
    b = med(paired)
    one = mem.get(str(size), {}).get("tier_blocking", {}).get("steady_ms")
    vs1 = f"; {steady['blocking'] / one:.2f}x 1 rank" if one else ""
    row(
        "2 ranks: tierckpt stall, max over ranks",
        steady["blocking"],
        f"{b:.2f}x 2-rank memcpy{vs1}",
        "<= 1.3",
        yes(b <= 1.3),
    )
    c = steady["committed"] / steady["memcpy"]
    row("2 ranks: tierckpt time-to-committed, max", steady["committed"], f"{c:.2f}x 2-rank memcpy")
    return out


def main() -> None:
    import torch.multiprocessing as mp

    args = parse_args()
    with running_daemon(CAPACITY_MB):
        port = free_port()
        mp.spawn(
            _rank,
            args=(2, port, args.size_mb, args.iters, args.interval, str(args.out)),
            nprocs=2,
            join=True,
        )
    print(f"results written to {args.out}")


if __name__ == "__main__":
    main()
