"""Run every benchmark scenario in one process tree: one table, one JSON, one throughput plot.

The suite is the list ``SCENARIOS`` below, in the order they run, each a module of its own (see
bench/README.md) that runs itself in a subprocess (``run(args, tmp, notes)``: its results, or
``None`` with a note) and gives its rows of the table (``rows(results)``):
- ``memory_tier.py`` at every ``--sizes`` (memcpy, torch default async_save, tierckpt, restores);
- ``rss.py``: the trainer's extra RSS during a tierckpt ``async_save`` vs. torch's default one;
- ``two_rank.py``: a 2-rank (spawn + gloo) tierckpt save stall, each rank saving half the state;
- ``persistent_tier.py`` (S3 upload/restore vs. s3torchconnector, training slowdown) at one size;
- ``peer_tier.py`` (replication, restore from a peer) and ``multi_node.py`` (commit across nodes);
- ``stall.py`` (the stall against torch's reused DefaultStager, 64 MiB-4 GiB);
- ``peers.py`` (beside DLRover, GEMINI and torch's stager; 1 rank, then 2 but in smoke mode);
- ``verified_copy.py``: the verified copy out of memory (hash while copying) against memcpy, 1 GiB;
- ``issue24.py``: issue 24's three figures (``--no-issue24`` skips them), for 1 rank, 2 ranks
  and PROCESS mode, from ``restore.py`` and ``stall.py`` runs;
- ``gpu_staging.py`` where CUDA is available (the pinned tier file against a raw D2H and torch's
  stager).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import _memory_report
import gpu_staging
import issue24
import memory_tier
import multi_node
import peer_tier
import peers
import persistent_tier
import rss
import stall
import two_rank
import verified_copy
from harness import Row, machine_info, table

WARMUP = 3  # saves before the daemon recycles files (keep_last 2 + 1): the ramp-up

SCENARIOS = {  # the results' key: the scenario's module, in the order they run
    "memory_tier": memory_tier,
    "rss": rss,
    "two_rank": two_rank,
    "persistent_tier": persistent_tier,
    "peer_tier": peer_tier,
    "multi_node": multi_node,
    "stall": stall,
    "peers": peers,
    "verified_copy": verified_copy,
    "issue24": issue24,
    "gpu_staging": gpu_staging,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes", default="256,512,1024,2048,4096", help="state sizes in MiB, comma-separated"
    )
    p.add_argument("--iters", type=int, default=10, help="saves per contender (> 3)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between saves (untimed)")
    p.add_argument("--checkpointer", choices=["thread", "process"], default="thread")
    p.add_argument("--rss-mb", type=int, default=1024, help="state size of the RSS scenario (MiB)")
    p.add_argument("--two-rank-mb", type=int, default=1024, help="total state of the 2-rank run")
    p.add_argument("--s3-size-mb", type=int, help="persistent_tier.py --size-mb (its default)")
    p.add_argument("--no-s3", action="store_true", help="skip the persistent tier (S3)")
    p.add_argument("--peer-size-mb", type=int, help="peer_tier.py --size-mb (its default)")
    p.add_argument("--no-peer", action="store_true", help="skip the peer tier (replication)")
    p.add_argument("--multi-size-mb", type=int, help="multi_node.py --size-mb (its default)")
    p.add_argument("--no-multi", action="store_true", help="skip the two-node scenario")
    p.add_argument(
        "--stall-sizes", default="64,256,1024,4096", help="stall.py --sizes (MiB; 4096 if it fits)"
    )
    p.add_argument("--no-stall", action="store_true", help="skip stall.py (vs torch's stager)")
    p.add_argument(
        "--no-peers", action="store_true", help="skip peers.py (DLRover, GEMINI, torch's stager)"
    )
    p.add_argument("--no-issue24", action="store_true", help="skip issue 24's figures")
    p.add_argument("--issue24-only", action="store_true", help="only issue 24's figures")
    p.add_argument("--out", type=Path, default=Path("bench/results/all.json"))
    p.add_argument("--plot", type=Path, default=Path("bench/results/throughput.png"))
    p.add_argument(
        "--smoke",
        action="store_true",
        help="32 and 64 MiB, 2 iterations, tiny S3 and peer runs (CI)",
    )
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.iters, args.interval = "32,64", 2, 0.0
        args.rss_mb, args.two_rank_mb = 32, 64
    args.size_list = sorted({int(s) for s in args.sizes.split(",")})
    if args.iters <= (1 if args.smoke else WARMUP):
        p.error(f"--iters must be more than {WARMUP} (the ramp-up saves)")
    return args


def run_scenarios(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any]:
    """Each scenario's results under its key; one that was left out or failed has none."""
    if args.issue24_only:
        return {"memory_tier": {}, "issue24": issue24.run(args, tmp, notes)}
    res: dict[str, Any] = {}
    for key, scenario in SCENARIOS.items():
        got = scenario.run(args, tmp, notes)
        if got is not None:
            res[key] = got
    return res


def render(res: dict[str, Any]) -> str:
    """The table: every scenario's rows, in the order they ran."""
    rows: list[Row] = []
    for scenario in SCENARIOS.values():
        rows += scenario.rows(res)
    return table(rows)


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    info = machine_info(
        sizes_mb=args.size_list,
        iters=args.iters,
        interval_s=args.interval,
        checkpointer=args.checkpointer,
        smoke=args.smoke,
    )
    print(
        f"machine: {info['cores']} cores, {info['mem_gib']} GiB, torch {info['torch']}, python "
        f"{info['python']}; sizes {args.size_list} MiB x {args.iters} iters, {args.checkpointer}"
    )
    notes: list[str] = []
    if args.smoke:
        notes.append("smoke mode: tiny sizes, 2 iterations, no pause between saves; not judged")
    with tempfile.TemporaryDirectory(prefix="tierckpt-bench-all-") as tmp:
        res = run_scenarios(args, Path(tmp), notes)
    text = render(res)  # (also adds the 2-rank summary to res)
    fc = _memory_report.fixed_cost(res["memory_tier"])
    if fc is not None:
        res["fixed_cost"] = fc
        notes.append(_memory_report.fixed_cost_note(fc))
    res["notes"] = notes
    res["wall_s"] = time.perf_counter() - t0
    print()
    print(text)
    for note in notes:
        print(f"\nnote: {note}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps({"machine": info, "results": res, "table": text}, indent=2) + "\n"
    )
    print(f"\nresults written to {args.out}")
    if res["memory_tier"]:
        _memory_report.plot(res, info, args.plot)
        print(f"plot written to {args.plot}")
    print(f"total {res['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
