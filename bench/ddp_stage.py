"""DDP staging benchmark (issue 38): bytes each rank copies at ``stage()`` and the stall, tierckpt
beside torch's reused stager, for a replicated (DDP-shaped) state on W spawned gloo ranks.

Every rank holds the whole state (``--size`` MiB in 16 float32 tensors, the same on every rank).
Per round, each rank in turn: ``async_save`` (THREAD) with ``TieredStorageWriter`` (the writer is
its own stager; from the second save on it copies only what DCP has this rank write), then
``async_save`` with one reused torch ``DefaultStager`` and ``FileSystemWriter`` into /dev/shm
(which copies the rank's whole state every save). Barriers between contenders; the stall is the
time ``async_save`` takes to return on the slower rank; each future is waited for (untimed).

Prints, per W: bytes copied per rank at ``stage()`` (tierckpt: ``last_stage_bytes`` of the
steady rounds; torch: the state's bytes), and the steady median stall of each with their ratio.
The target: bytes copied per rank = bytes written by that rank (~size / W), a stall that falls
with W. Figures are to be measured on a quiet machine; this box is shared.

    python bench/ddp_stage.py --ranks 2 4 --size 256 --iters 8 [--out results.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import free_port, machine_info, make_state, start_daemon, write_results
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.dcp import TieredStorageWriter

N_TENSORS = 16


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--size", type=int, default=256, help="MiB of state per rank (replicated)")
    p.add_argument("--iters", type=int, default=8, help="rounds; the first two are warm-up")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


def timed_save(sd: dict[str, Any], **kw: Any) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, async_checkpointer_type=AsyncCheckpointerType.THREAD, **kw)
    stall = time.perf_counter() - t0
    fut.result()
    return stall


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, root: str, out: str):
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sd = make_state(args.size, name="layer{i}.weight")  # the same on every rank: replicated
        stager = DefaultStager(StagingOptions(False, False, False, False))
        rows = []
        for i in range(args.iters):
            writer = TieredStorageWriter(f"ddp{world}", i + 1)
            tier = timed_save(sd, storage_writer=writer)
            fs = FileSystemWriter(os.path.join(root, f"fs{world}"), overwrite=True)
            torch_s = timed_save(sd, storage_writer=fs, async_stager=stager)
            rows.append((tier, torch_s, writer.last_stage_bytes))
        every: list[Any] = [None] * world
        dist.all_gather_object(every, rows)
        if rank == 0:
            Path(out).write_text(repr(every))
        stager.close()
    finally:
        dist.destroy_process_group()


def run_world(world: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    import ast

    import torch.multiprocessing as mp

    shm = root / f"tier-{world}"
    capacity = 4 * args.size * world + 256
    daemon = start_daemon(capacity, shm_dir=shm, log_path=root / f"daemon-{world}.log")
    out = root / f"rows-{world}.txt"
    try:
        mp.spawn(run_rank, args=(world, free_port(), args, str(root), str(out)), nprocs=world)
        every = ast.literal_eval(out.read_text())
    finally:
        daemon.stop(timeout=10)
        shutil.rmtree(shm, ignore_errors=True)
    steady = range(min(2, args.iters - 1), args.iters)
    tier = [max(r[i][0] for r in every) for i in steady]
    torch_s = [max(r[i][1] for r in every) for i in steady]
    state_bytes = args.size * (1 << 20) // 4 // N_TENSORS * 4 * N_TENSORS
    return {
        "state_bytes_per_rank": state_bytes,
        "tier_copied_bytes_per_rank": [r[-1][2] for r in every],
        "tier_first_save_copied_bytes_per_rank": [r[0][2] for r in every],
        "torch_copied_bytes_per_rank": state_bytes,
        "tier_stall_ms": statistics.median(tier) * 1e3,
        "torch_stall_ms": statistics.median(torch_s) * 1e3,
        "ratio_tier_over_torch": statistics.median(
            a / b for a, b in zip(tier, torch_s, strict=True)
        ),
    }


def main() -> None:
    args = parse_args()
    root = Path(tempfile.mkdtemp(prefix="tierckpt-ddp-stage-", dir="/dev/shm"))
    results = {}
    try:
        for world in args.ranks:
            results[str(world)] = r = run_world(world, args, root)
            copied = ", ".join(f"{b / 2**20:.1f}" for b in r["tier_copied_bytes_per_rank"])
            print(
                f"W={world}: copied per rank MiB tierckpt [{copied}] torch "
                f"{r['torch_copied_bytes_per_rank'] / 2**20:.1f}; stall ms tierckpt "
                f"{r['tier_stall_ms']:.1f} torch {r['torch_stall_ms']:.1f} "
                f"(ratio {r['ratio_tier_over_torch']:.2f})"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if args.out is not None:
        write_results(args.out, machine_info(size_mib=args.size, iters=args.iters), results)


if __name__ == "__main__":
    main()
