"""Memory-tier benchmark: tierckpt async_save/load vs. memcpy and torch's default DCP path.

Starts a real daemon, then times, on one ~1 GB CPU state dict (see bench/README.md):
(a) memcpy into pre-touched tensors, (b) ``async_save`` with ``FileSystemWriter`` into /dev/shm,
(c) ``async_save`` with ``TieredStorageWriter``, (d) ``dcp.load`` with each reader.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _memory_report import ratios, render
from _memory_report import rows as rows  # the suite's rows
from harness import (
    EXTRA,
    check_equal,
    free_port,
    machine_info,
    make_state,
    memcpy,
    mutate,
    paired_ratio,
    run_child,
    start_daemon,
    tensors,
    write_results,
    zeros_like_state,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from tierckpt_client import DaemonClient
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

NAMESPACE = "bench"
KEEP_LAST = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mb", type=int, default=1024, help="tensor bytes of the state dict (MiB)")
    p.add_argument("--iters", type=int, default=10, help="saves per contender (> --warmup)")
    p.add_argument(
        "--interval",
        type=float,
        default=2.0,
        help="seconds of (simulated) training between saves, untimed; the daemon pre-faults "
        "spare files meanwhile, as it would during real training",
    )
    p.add_argument(
        "--warmup",
        type=int,
        help="leading saves left out of the steady median (default: keep_last + 1, the saves "
        "before the daemon recycles files; 1 in smoke mode)",
    )
    p.add_argument("--keep-last", type=int, default=2, help="the daemon's TIERCKPT_KEEP_LAST")
    p.add_argument("--checkpointer", choices=["thread", "process"], default="thread")
    p.add_argument(
        "--tier-dir",
        type=Path,
        default=Path("/dev/shm"),
        help="tmpfs under which the daemon's tier directory is made (e.g. one mounted with "
        "huge=within_size); torch's FileSystemWriter baseline always writes into /dev/shm",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/memory_tier.json"))
    p.add_argument("--smoke", action="store_true", help="64 MiB, 2 iterations (CI)")
    args = p.parse_args()
    if args.smoke:
        args.size_mb, args.iters, args.interval, args.warmup = 64, 2, 0.0, 1
    if args.keep_last < 1:
        p.error("--keep-last must be at least 1")
    if args.warmup is None:
        args.warmup = args.keep_last + 1
    if not 1 <= args.warmup < args.iters:
        p.error(f"--iters ({args.iters}) must exceed --warmup ({args.warmup}), which must be >= 1")
    return args


class FloorWriter(StorageWriter, AsyncStager):
    """DCP's own floor: staging copies into reused, pre-touched tensors (the same memcpy as the
    baseline) and the storage writer stores nothing. Its stall and time-to-committed are what
    ``async_save`` costs around one memcpy with no storage at all."""

    _synchronize_after_execute = False

    def __init__(self, cache: dict[str, Any]) -> None:
        super().__init__()
        self.cache = cache
        self.staged = 0  # checked: DCP must stage through this, not its default stager

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.staged += 1
        out = {}
        for k, v in state_dict.items():
            if isinstance(v, torch.Tensor):
                out[k] = self.cache[k].copy_(v)
            else:
                out[k] = v
        return out

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        pass

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results = [
            WriteResult(index=item.index, size_in_bytes=0, storage_data=None) for item in plan.items
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def summary(times: list[float], nbytes: int, warmup: int) -> dict[str, Any]:
    """``cold``: the first iteration; ``steady``: the median of those after ``warmup``."""
    steady = statistics.median(times[warmup:])
    return {
        "cold_ms": times[0] * 1e3,
        "steady_ms": steady * 1e3,
        "steady_gbps": nbytes / steady / 1e9,
        "all_ms": [t * 1e3 for t in times],
    }


def bench_memcpy(sd: dict[str, Any], dst: dict[str, Any], iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        mutate(sd)
        times.append(memcpy(tensors(dst), tensors(sd)))
    return times


def bench_save(
    sd: dict[str, Any],
    dst: dict[str, Any],
    iters: int,
    make_writer: Callable[[int], Any],
    save_kwargs: dict[str, Any],
    before: Callable[[int], None] = lambda i: None,
    interval: float = 0.0,
) -> tuple[list[float], list[float], list[float]]:
    """Each iteration: a memcpy of the state into ``dst`` (the paired baseline, timed), then an
    ``async_save`` of it: returns (memcpy, blocking, committed) seconds per iteration."""
    paired, blocking, committed = [], [], []
    for i in range(iters):
        if i:
            time.sleep(interval)
        mutate(sd)
        paired.append(memcpy(tensors(dst), tensors(sd)))
        before(i)
        writer = make_writer(i)
        t0 = time.perf_counter()
        fut = dcp.async_save(sd, storage_writer=writer, **save_kwargs)
        t1 = time.perf_counter()
        fut.result()
        t2 = time.perf_counter()
        blocking.append(t1 - t0)
        committed.append(t2 - t0)
    return paired, blocking, committed


def bench_load(
    dest: dict[str, Any],
    iters: int,
    make_reader: Callable[[], Any],
    want: dict[str, Any],
    what: str,
    paired: list[float] | None = None,
) -> list[float]:
    """``iters`` loads into ``dest`` (zeroed before each, untimed); with ``paired``, each load
    right after a memcpy of the state into ``dest`` (timed into ``paired``): the restore's own
    baseline, taken under the same load as the restore itself."""
    times = []
    for _ in range(iters):
        if paired is not None:
            paired.append(memcpy(tensors(dest), tensors(want)))
        for t in tensors(dest):
            t.zero_()
        t0 = time.perf_counter()
        dcp.load(dest, storage_reader=make_reader(), no_dist=True)
        times.append(time.perf_counter() - t0)
        check_equal(dest, want, what)
    return times


def measure(args: argparse.Namespace, fs_root: Path) -> dict[str, Any]:
    # Memory: the state, one destination (memcpy target and restore destination), then either
    # torch's staged copy and files (dropped before the tier's turn) or keep_last + 1 tier files.
    sd = make_state(args.size_mb, extra=EXTRA)
    dst = zeros_like_state(sd)  # allocated and touched outside every timing
    nbytes = sum(t.numel() * t.element_size() for t in tensors(sd))
    warm = args.warmup
    kwargs: dict[str, Any] = {"async_checkpointer_type": AsyncCheckpointerType(args.checkpointer)}
    if not dist.is_initialized():
        kwargs["no_dist"] = True
    res: dict[str, Any] = {"warmup": warm, "keep_last": args.keep_last}
    res["memcpy"] = summary(bench_memcpy(sd, dst, args.iters), nbytes, warm)

    def fs_dir(i: int) -> Path:
        return fs_root / f"step_{i}"

    def drop_previous(i: int) -> None:
        shutil.rmtree(fs_dir(i - 1), ignore_errors=True)

    m, b, c = bench_save(
        sd,
        dst,
        args.iters,
        lambda i: FileSystemWriter(fs_dir(i)),
        kwargs,
        drop_previous,
        args.interval,
    )
    res["torch_memcpy"] = summary(m, nbytes, warm)
    res["torch_blocking"], res["torch_committed"] = (
        summary(b, nbytes, warm),
        summary(c, nbytes, warm),
    )
    fs_reader = lambda: FileSystemReader(fs_dir(args.iters - 1))  # noqa: E731
    res["restore_fs"] = summary(bench_load(dst, args.iters, fs_reader, sd, "fs"), nbytes, 1)
    shutil.rmtree(fs_root, ignore_errors=True)
    torch_paired = paired_ratio(b, m, warm)

    floor = FloorWriter({k: torch.empty_like(v).fill_(0) for k, v in sd.items() if k != "extra"})
    m, b, c = bench_save(sd, dst, args.iters, lambda i: floor, kwargs)
    if floor.staged != args.iters:
        raise RuntimeError(
            f"DCP staged the floor's saves elsewhere ({floor.staged} of {args.iters})"
        )
    floor.cache.clear()  # give its memory back before the tier's turn
    res["floor_memcpy"] = summary(m, nbytes, warm)
    res["floor_blocking"], res["floor_committed"] = (
        summary(b, nbytes, warm),
        summary(c, nbytes, warm),
    )
    floor_paired = (paired_ratio(b, m, warm), paired_ratio(c, m, warm))

    client = DaemonClient()
    recycled: list[bool] = []  # can this save's lease take a file back from the daemon's pool?

    def note_pool(i: int) -> None:
        recycled.append(client.status().pool_bytes >= nbytes)

    def tier_writer(i: int) -> TieredStorageWriter:
        return TieredStorageWriter(NAMESPACE, step=i + 1)

    m, b, c = bench_save(sd, dst, args.iters, tier_writer, kwargs, note_pool, args.interval)
    res["tier_memcpy"] = summary(m, nbytes, warm)
    res["tier_blocking"], res["tier_committed"] = summary(b, nbytes, warm), summary(c, nbytes, warm)
    res["tier_blocking"]["recycled"] = recycled
    res["paired"] = {
        "tier_blocking_over_memcpy": paired_ratio(b, m, warm),
        "tier_committed_over_memcpy": paired_ratio(c, m, warm),
        "tier_blocking_over_memcpy_best": paired_ratio(b, m, warm, best=True),
        "tier_committed_over_memcpy_best": paired_ratio(c, m, warm, best=True),
        "torch_blocking_over_memcpy": torch_paired,
        "floor_blocking_over_memcpy": floor_paired[0],
        "floor_committed_over_memcpy": floor_paired[1],
    }
    tier_reader = lambda: TieredStorageReader(NAMESPACE, step=args.iters)  # noqa: E731
    pm: list[float] = []
    r = bench_load(dst, args.iters, tier_reader, sd, "tier", pm)
    res["restore_memcpy"] = summary(pm, nbytes, 1)
    res["restore_tier"] = summary(r, nbytes, 1)
    # Restore bandwidth over the memcpy timed right before each restore (memcpy time / restore
    # time), as the saves are paired: the machine's drift over the run hits both alike. The
    # first restore (a new reader's first connection and mapping lookups) is left out.
    res["paired"]["tier_restore_over_memcpy"] = 1 / paired_ratio(r, pm, 1)
    res["paired"]["tier_restore_over_memcpy_best"] = 1 / paired_ratio(r, pm, 1, best=True)
    # The same restore with tensors not checked against their checksums (TIERCKPT_VERIFY_READS=0):
    # what verification costs.
    unverified = ClientConfig.from_env(verify_reads=False)
    raw_reader = lambda: TieredStorageReader(NAMESPACE, step=args.iters, config=unverified)  # noqa: E731
    pm = []
    r = bench_load(dst, args.iters, raw_reader, sd, "tier", pm)
    res["restore_tier_unverified"] = summary(r, nbytes, 1)
    res["paired"]["tier_restore_unverified_over_memcpy"] = 1 / paired_ratio(r, pm, 1)
    client.close()
    res["memcpy_late"] = summary(bench_memcpy(sd, dst, args.iters), nbytes, warm)
    s = {k: v["steady_ms"] for k, v in res.items() if isinstance(v, dict) and "steady_ms" in v}
    res["ratios"] = ratios(s, res["paired"])
    res["bytes"] = nbytes
    return res


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any]:
    """The suite's run: this script at every ``--sizes`` that fits in memory, by size."""
    res: dict[str, Any] = {}
    avail = mem_available_mib()
    for size in args.size_list:
        # This holds the state, one destination, and keep_last + 1 tier files (torch's staged
        # copy and files before that): 5x the state with keep_last 2, 4x with 1.
        keep_last = 2 if size * 5.5 <= avail else 1
        if size * 4.5 > avail:
            notes.append(
                f"{size} MiB skipped: memory_tier.py needs ~4.5x the state "
                f"(~{size * 4.5 / 1024:.0f} GiB), {avail / 1024:.1f} GiB available"
            )
            continue
        if keep_last != 2:
            notes.append(f"{size} MiB run with TIERCKPT_KEEP_LAST=1 to fit in memory")
        cmd = ["--size-mb", str(size), "--iters", str(args.iters), "--interval", str(args.interval)]
        cmd += ["--checkpointer", args.checkpointer, "--keep-last", str(keep_last)]
        cmd += ["--warmup", "1"] if args.smoke else []
        out = tmp / f"mt_{size}.json"
        run_child([sys.executable, __file__, *cmd, "--out", str(out)], f"memory tier, {size} MiB")
        res[str(size)] = json.loads(out.read_text())["results"]  # a size that fails fails the suite
    return res


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    tag = uuid.uuid4().hex[:8]
    shm_dir = args.tier_dir / f"tierckpt-bench-{tag}"
    fs_root = Path(f"/dev/shm/tierckpt-bench-fs-{tag}")
    log = Path(tempfile.gettempdir()) / f"tierckpt-bench-{tag}.log"
    info = machine_info(size_mb=args.size_mb, iters=args.iters, checkpointer=args.checkpointer)
    print(
        f"machine: {info['cores']} cores, {info['mem_gib']} GiB, torch {info['torch']}, "
        f"python {info['python']}; {args.size_mb} MiB x {args.iters} iters, {args.checkpointer}"
    )
    daemon = None
    try:
        capacity = (args.keep_last + 1) * args.size_mb + 1024  # keep_last + 1 steps, and slack
        daemon = start_daemon(capacity, keep_last=args.keep_last, shm_dir=shm_dir, log_path=log)
        if args.checkpointer == "process":
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
        res = measure(args, fs_root)
    except BaseException:
        if log.exists():
            print(f"daemon log (tail):\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if daemon is not None:
            daemon.stop(timeout=10)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(fs_root, ignore_errors=True)
        log.unlink(missing_ok=True)
    print(render(res))
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
