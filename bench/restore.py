"""Restore benchmark (issue 24): a verified restore from this node's memory against a memcpy, and
a restore's fixed cost, per round trip.

One real daemon; a CPU state dict of 16 float32 tensors, saved once per size (``async_save``,
THREAD or ``--checkpointer process``), then ``--iters`` rounds of, in this order:

1. a memcpy of the state into the destination tensors (pre-touched; the paired baseline),
2. the destination zeroed (untimed), then ``dcp.load`` with ``TieredStorageReader`` into it
   (verified, as by default), checked bit-exact (untimed),
3. DCP's own fixed cost: ``dcp.load`` of the state's keys as one-element tensors through
   ``FileSystemReader`` from /dev/shm (:func:`floor_state`), and ours outside the copy over it.

Per size: the paired ratio memcpy time / restore time (restore GB/s over memcpy GB/s: median and
best over the rounds after the first); restore - paired memcpy; and the time outside the copy
(the restore less its time in the reader's verified copies), split into the daemon round trips
the load made (each timed: method and route; a pin sent ahead by ``read_metadata`` is its send,
and ``read_data``'s wait for its answer) and the rest (DCP's planning, the metadata's decoding,
the reader's own work); and the calling thread's CPU time outside the copies, which a
busy machine inflates least.

``--fresh``: also the first restore in a new process (the restart after a failure: the step's
files are not mapped there, so they are read with ``preadv``), against a memcpy in that process.

``--ranks 2``: spawned gloo ranks, each with its share of the state (``size / ranks``); each
round both ranks copy, then both restore, between barriers; figures of the slower rank.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
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
from harness import (
    EXTRA,
    check_equal,
    free_port,
    machine_info,
    make_state,
    start_daemon,
    tensors,
    write_results,
    zeros_like_state,
)
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client import _reads
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp.sources import files

NAMESPACE = "restore"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,1024", help="state sizes in MiB (all ranks together)")
    p.add_argument("--iters", type=int, default=12, help="rounds per size (> 1)")
    p.add_argument("--ranks", type=int, default=1, help="1, or spawned gloo ranks")
    p.add_argument("--checkpointer", choices=["thread", "process"], default="thread")
    p.add_argument("--fresh", action="store_true", help="also the first restore in a new process")
    p.add_argument(
        "--settle",
        type=float,
        default=3.0,
        help="seconds between the save and the restores (the daemon pre-faults spare files "
        "right after a commit: its requests answer slower meanwhile)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/restore.json"))
    p.add_argument("--smoke", action="store_true", help="16 MiB, 3 rounds (CI)")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)  # --fresh: the new process
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.iters = "16", 3
    args.size_list = [int(s) for s in args.sizes.split(",")]
    if args.iters < 2:
        p.error("--iters must be at least 2 (the first round is left out)")
    return args


class RoundTrips:
    """Times every request this process makes to its daemon, by method and route; and the time
    spent in the reader's verified copies (``copy``, seconds since the last :meth:`take`)."""

    def __init__(self) -> None:
        self.made: list[tuple[str, float]] = []
        self.copy = 0.0
        self.copy_cpu = 0.0
        self._real = DaemonClient._request
        for name in ("copy_all", "copy_verified"):  # (the reader before issue 24's batch copy)
            real = getattr(files, name, None)
            if real is not None:
                setattr(files, name, self._timed_copy(real))

        def timed(client: DaemonClient, method: str, path: str, *a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return self._real(client, method, path, *a, **k)
            finally:
                route = path.split("?")[0].rsplit("/", 2)
                what = route[-1] if method != "DELETE" else f"{route[-2]}/<id>"
                self.made.append((f"{method} {what}", time.perf_counter() - t0))

        DaemonClient._request = timed  # type: ignore[method-assign]
        # A pin sent ahead (read_metadata) is one request sent there, its answer waited for in
        # read_data: that wait is the round trip's time left on the load's path.
        real_wait = _reads.Ahead.wait

        def waited(ahead: _reads.Ahead, timeout: float) -> bool:
            t0 = time.perf_counter()
            try:
                return real_wait(ahead, timeout)
            finally:
                self.made.append(("pin sent ahead: waited", time.perf_counter() - t0))

        _reads.Ahead.wait = waited  # type: ignore[method-assign]

    def _timed_copy(self, real: Callable[..., int]) -> Callable[..., int]:
        def timed(*a: Any, **k: Any) -> int:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return real(*a, **k)
            finally:
                self.copy += time.perf_counter() - t0
                self.copy_cpu += time.thread_time() - c0

        return timed

    def take(self) -> tuple[list[tuple[str, float]], float, float]:
        """The requests made, and the wall and calling-thread CPU seconds in the copies, since
        the last call."""
        made, copy, copy_cpu = self.made, self.copy, self.copy_cpu
        self.made, self.copy, self.copy_cpu = [], 0.0, 0.0
        return made, copy, copy_cpu


def save(size_mb: int, step: int, checkpointer: str, rank: int = 0) -> dict[str, Any]:
    half = make_state(size_mb, extra=EXTRA)
    sd: dict[str, Any] = {f"r{rank}.{k}": v for k, v in half.items() if k != "extra"}
    sd["extra"] = half["extra"]
    kwargs: dict[str, Any] = {"async_checkpointer_type": AsyncCheckpointerType(checkpointer)}
    if not dist.is_initialized():
        kwargs["no_dist"] = True
    writer = TieredStorageWriter(NAMESPACE, step=step)
    dcp.async_save(sd, storage_writer=writer, **kwargs).result()
    return sd


def floor_state(sd: dict[str, Any], where: Path) -> tuple[dict[str, Any], FileSystemReader]:
    """DCP's own fixed cost, the floor under any storage reader: the state's keys and
    structure with one-element tensors, saved once with ``FileSystemWriter`` under ``where`` (in
    /dev/shm) by every rank; what ``dcp.load`` of it takes is DCP's planning, its collectives
    and one small file read per rank, next to nothing of a copy."""
    tiny = {k: (torch.ones(1) if isinstance(v, torch.Tensor) else v) for k, v in sd.items()}
    kwargs: dict[str, Any] = {} if dist.is_initialized() else {"no_dist": True}
    dcp.save(tiny, storage_writer=FileSystemWriter(str(where)), **kwargs)
    return zeros_like_state(tiny), FileSystemReader(str(where))


def rounds(
    sd: dict[str, Any],
    step: int,
    iters: int,
    trips: RoundTrips,
    sync: Callable[[], None],
    floor: tuple[dict[str, Any], FileSystemReader],
) -> list[dict[str, Any]]:
    """Paired memcpy, then restore, then DCP's floor (:func:`floor_state`), ``iters`` times:
    per round the three times (s) and the round trips of the restore."""
    dst = zeros_like_state(sd)
    src, out = tensors(sd), tensors(dst)
    kwargs: dict[str, Any] = {} if dist.is_initialized() else {"no_dist": True}
    res = []
    for _ in range(iters):
        sync()
        t0 = time.perf_counter()
        for d, s in zip(out, src, strict=True):
            d.copy_(s)
        memcpy = time.perf_counter() - t0
        for t in out:
            t.zero_()
        sync()
        trips.take()
        c0, t0 = time.thread_time(), time.perf_counter()
        dcp.load(dst, storage_reader=TieredStorageReader(NAMESPACE, step=step), **kwargs)
        load, cpu = time.perf_counter() - t0, time.thread_time() - c0
        made, copy, copy_cpu = trips.take()
        check_equal(dst, sd, "restore")
        sync()
        t0 = time.perf_counter()
        dcp.load(floor[0], storage_reader=floor[1], **kwargs)
        dcp_floor = time.perf_counter() - t0
        res.append(
            {
                "memcpy_s": memcpy,
                "dcp_floor_s": dcp_floor,
                "restore_s": load,
                "copy_s": copy,
                "cpu_outside_copy_s": cpu - copy_cpu,
                "round_trips": made,
            }
        )
    return res


def summarize(per_rank: list[list[dict[str, Any]]], nbytes: int) -> dict[str, Any]:
    """The slower rank's figures per round, rounds after the first."""
    rows = [max(r, key=lambda x: x["restore_s"]) for r in zip(*per_rank, strict=True)][1:]
    med = statistics.median
    ratio = [r["memcpy_s"] / r["restore_s"] for r in rows]
    fixed = [(r["restore_s"] - r["memcpy_s"]) * 1e3 for r in rows]
    # Outside the copy: the restore less its time in the verified copies (on a loaded machine
    # torch's memcpy can take longer than the restore's copy, and restore - memcpy goes < 0).
    outside = [(r["restore_s"] - r["copy_s"]) * 1e3 for r in rows]
    trips: dict[str, list[float]] = {}
    for r in rows:
        for what, s in r["round_trips"]:
            trips.setdefault(what, []).append(s * 1e3)
    n_trips = [sum(not w.startswith("pin sent ahead") for w, _ in r["round_trips"]) for r in rows]
    trips_ms = [sum(s for _, s in r["round_trips"]) * 1e3 for r in rows]
    return {
        "bytes": nbytes,
        "memcpy_ms": med(r["memcpy_s"] for r in rows) * 1e3,
        "restore_ms": med(r["restore_s"] for r in rows) * 1e3,
        "restore_over_memcpy": med(ratio),  # GB/s over memcpy GB/s
        "restore_over_memcpy_best": max(ratio),
        "fixed_ms": med(fixed),
        "fixed_ms_best": min(fixed),
        "copy_ms": med(r["copy_s"] for r in rows) * 1e3,
        "outside_copy_ms": med(outside),
        "outside_copy_ms_best": min(outside),
        # DCP's own fixed cost (FileSystemReader, one-element tensors), in the same rounds; and
        # what ours adds over it, per round.
        "dcp_floor_ms": med(r["dcp_floor_s"] for r in rows) * 1e3,
        "outside_copy_over_floor_ms": med(
            o - r["dcp_floor_s"] * 1e3 for o, r in zip(outside, rows, strict=True)
        ),
        # The load's CPU on the calling thread outside the copies: what a busy machine inflates
        # least (its wall clock waits for the daemon and for cores).
        "cpu_outside_copy_ms": med(r["cpu_outside_copy_s"] for r in rows) * 1e3,
        "round_trips": med(n_trips),
        "round_trips_ms": med(trips_ms),
        "round_trip_ms": {k: med(v) for k, v in trips.items()},
        "rest_ms": med(f - t for f, t in zip(outside, trips_ms, strict=True)),
        "rounds": rows,
    }


CHILD = """
import sys, time
sys.path.insert(0, {bench!r})
import torch.distributed.checkpoint as dcp
from harness import EXTRA, make_state, zeros_like_state, tensors, check_equal
from tierckpt_client.dcp import TieredStorageReader
sd = make_state({size}, extra=EXTRA)
sd = {{f"r0.{{k}}": v for k, v in sd.items() if k != "extra"}} | {{"extra": sd["extra"]}}
dst = zeros_like_state(sd); src = zeros_like_state(sd)
for a, b in zip(tensors(src), tensors(sd)): a.copy_(b)
t0 = time.perf_counter()
for a, b in zip(tensors(dst), tensors(src)): a.copy_(b)
memcpy = time.perf_counter() - t0
for t in tensors(dst): t.zero_()
reader = TieredStorageReader({ns!r}, step={step})
t0 = time.perf_counter()
dcp.load(dst, storage_reader=reader, no_dist=True)
load = time.perf_counter() - t0
check_equal(dst, sd, "fresh")
print("RESULT", memcpy, load)
"""


def fresh(size_mb: int, step: int, iters: int) -> dict[str, Any]:
    """The first restore in a new process, ``iters`` processes: memcpy / restore in each."""
    ratios, loads = [], []
    code = CHILD.format(bench=str(Path(__file__).parent), size=size_mb, ns=NAMESPACE, step=step)
    for _ in range(iters):
        out = subprocess.run(
            [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True
        )
        if out.returncode:
            raise RuntimeError(f"fresh restore failed:\n{out.stderr[-3000:]}")
        line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT"))
        memcpy, load = map(float, line.split()[1:])
        ratios.append(memcpy / load)
        loads.append(load * 1e3)
    return {
        "restore_ms": statistics.median(loads),
        "restore_over_memcpy": statistics.median(ratios),
        "restore_over_memcpy_best": max(ratios),
        "all_ratios": ratios,
    }


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if world > 1 or args.checkpointer == "process":
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    sync = dist.barrier if dist.is_initialized() else (lambda: None)
    trips = RoundTrips()
    res: dict[str, Any] = {}
    try:
        for i, size in enumerate(args.size_list):
            sd = save(size // world, i + 1, args.checkpointer, rank)
            floor = floor_state(sd, Path(args.floor_dir) / str(size))
            time.sleep(args.settle)
            mine = rounds(sd, i + 1, args.iters, trips, sync, floor)
            every: list[Any] = [mine]
            if dist.is_initialized():
                every = [None] * world
                dist.all_gather_object(every, mine)
            nbytes = sum(t.numel() * t.element_size() for t in tensors(sd)) * world
            res[str(size)] = summarize(every, nbytes)
            if args.fresh and world == 1:
                res[str(size)]["fresh"] = fresh(size, i + 1, max(3, args.iters // 3))
            del sd
        if rank == 0:
            Path(out).write_text(repr(res))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def render(res: dict[str, Any]) -> str:
    lines = [
        "| size | memcpy ms | restore ms | restore / memcpy GB/s (best) | restore - memcpy ms "
        "(best) | copy ms | outside the copy ms (best) | DCP's floor ms (outside the copy over it) "
        "| round trips: n, ms | the rest ms | main-thread CPU outside the copy ms |",
        "|---:|---:|---:|---|---|---:|---|---|---|---:|---:|",
    ]
    for size, r in res.items():
        each = ", ".join(f"{k} {v:.2f}" for k, v in r["round_trip_ms"].items())
        lines.append(
            f"| {size} MiB | {r['memcpy_ms']:.1f} | {r['restore_ms']:.1f} | "
            f"{r['restore_over_memcpy']:.2f} ({r['restore_over_memcpy_best']:.2f}) | "
            f"{r['fixed_ms']:.1f} ({r['fixed_ms_best']:.1f}) | {r['copy_ms']:.1f} | "
            f"{r['outside_copy_ms']:.1f} ({r['outside_copy_ms_best']:.1f}) | "
            f"{r['dcp_floor_ms']:.1f} ({r['outside_copy_over_floor_ms']:+.1f}) | {r['round_trips']:.0f}, "
            f"{r['round_trips_ms']:.1f} ({each}) | {r['rest_ms']:.1f} | "
            f"{r['cpu_outside_copy_ms']:.1f} |"
        )
        if "fresh" in r:
            f = r["fresh"]
            lines.append(
                f"| {size} MiB | | {f['restore_ms']:.1f} | {f['restore_over_memcpy']:.2f} "
                f"({f['restore_over_memcpy_best']:.2f}) first restore in a new process | | | | | | | |"
            )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    import ast

    tag = uuid.uuid4().hex[:8]
    shm_dir = Path(f"/dev/shm/tierckpt-bench-restore-{tag}")
    args.floor_dir = f"/dev/shm/tierckpt-bench-restore-floor-{tag}"  # DCP's floor, FileSystemWriter
    log = Path(tempfile.gettempdir()) / f"tierckpt-bench-restore-{tag}.log"
    info = machine_info(
        sizes_mb=args.size_list,
        iters=args.iters,
        ranks=args.ranks,
        checkpointer=args.checkpointer,
        load=os.getloadavg(),
    )
    print(
        f"machine: {info['cores']} cores, torch {info['torch']}; sizes {args.size_list} MiB, "
        f"{args.ranks} rank(s), {args.checkpointer}, {args.iters} rounds; load {info['load']}"
    )
    keep = len(args.size_list)
    capacity = (keep + 1) * max(args.size_list) * 2 + 1024  # keep_last + 1 steps, and slack
    daemon = start_daemon(capacity, keep_last=keep, shm_dir=shm_dir, log_path=log)
    out = Path(tempfile.gettempdir()) / f"tierckpt-bench-restore-{tag}.txt"
    try:
        port = free_port()
        if args.ranks > 1:
            import torch.multiprocessing as mp

            mp.spawn(run_rank, args=(args.ranks, port, args, str(out)), nprocs=args.ranks)
        else:
            run_rank(0, 1, port, args, str(out))
        res = ast.literal_eval(out.read_text())
    except BaseException:
        if log.exists():
            print(f"daemon log (tail):\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        daemon.stop(timeout=10)
        shutil.rmtree(shm_dir, ignore_errors=True)
        shutil.rmtree(args.floor_dir, ignore_errors=True)
        log.unlink(missing_ok=True)
        out.unlink(missing_ok=True)
    info["load_after"] = os.getloadavg()
    print(render(res))
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
