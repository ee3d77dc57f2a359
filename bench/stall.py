"""Stall benchmark: tierckpt ``async_save`` against torch's best stager, per state size.

For each size (default 64, 256, 1024 MiB, and 4096 when ``MemAvailable`` allows), one real daemon,
one CPU state dict of 16 float32 tensors, and ``--iters`` rounds. Each round, in this order:

1. memcpy of the state into pre-touched tensors (the paired floor),
2. ``async_save`` with ``TieredStorageWriter`` (THREAD mode, or PROCESS with ``--mode process``;
   the writer is its own stager),
3. ``async_save`` with one reused torch ``DefaultStager`` and ``FileSystemWriter`` into /dev/shm.

``--ranks 2``: spawned gloo ranks save one state together, each its share (``size / ranks``),
between barriers; per round each contender's stall on its slower rank.

The contenders alternate within every round, so load on a shared machine hits both alike, and
which of them comes right after the memcpy floor alternates from round to round (``--fixed-order``:
tierckpt always; the floor's ``copy_`` leaves torch's OpenMP workers spinning for a few ms, which
taxes whatever copies next on a 2-core machine and helps a ``copy_`` that follows). The
stall is the time ``async_save`` takes to return; each future is waited for (untimed) before the
next save. torch's stager is configured as its fastest honest CPU setting: synchronous staging
(``use_async_staging=False``: an asynchronous stager returns before the copy is done, and the
trainer would then have to wait on ``staging_completion`` before touching its tensors), no pinned
memory (needs CUDA), no shared memory (THREAD mode needs none) and blocking copies; reused, so its
cached CPU storages are already allocated and touched from the second save on.

The tierckpt stall is also broken down into phases (``stage`` split into the size walk, the daemon
lease round trip or the pre-lease claim, the mapping lookup and the copy; the rest of
``async_save``), timed by wrapping those functions for the run. CPU-seconds of this process
(``os.times``) and of the daemon (``/proc/<pid>/stat``) are taken per contender.

JSON (``--out``), per size under ``results.sizes["<MiB>"]``: ``tier_stall_ms``,
``torch_stall_ms``, ``memcpy_ms`` (steady medians), ``ratio_tier_over_torch`` (median over rounds
of the paired ratio) and ``..._best`` (minimum), ``tier_stall_minus_memcpy_ms`` and
``torch_stall_minus_memcpy_ms`` (median of the per-round differences), ``phases_ms`` (medians),
``prelease_claimed`` (rounds whose stage used a pre-lease), ``cpu_s``.
"""

from __future__ import annotations

import argparse
import ast
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import harness
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from harness import Row, child_results, free_port, machine_info, write_results, yes
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.config import ClientConfig
from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import _arena, _prelease
from tierckpt_client.dcp import writer as writer_module

N_TENSORS = 16
KEEP_LAST = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--sizes", default="64,256,1024,4096", help="state sizes in MiB, comma-separated"
    )
    p.add_argument("--iters", type=int, default=12, help="rounds per size (> --warmup)")
    p.add_argument(
        "--warmup", type=int, default=KEEP_LAST + 2, help="leading rounds left out (ramp-up)"
    )
    p.add_argument(
        "--interval", type=float, default=0.5, help="seconds between rounds (untimed training)"
    )
    p.add_argument(
        "--before",
        action="store_true",
        help="a third contender in every round: tierckpt with pre-leases off (TIERCKPT_PRELEASE=0), "
        "in its own namespace (needs keep_last + 1 more files of the state)",
    )
    p.add_argument(
        "--tensors",
        type=int,
        default=N_TENSORS,
        help="float32 tensors the state is split into (many small ones: the per-tensor costs)",
    )
    p.add_argument(
        "--mode",
        choices=("thread", "process"),
        default="thread",
        help="async_save's checkpointer type; process: torch's stager stages into shared memory "
        "(what its helper process needs), and each contender's first save (the helper's start) "
        "falls in the warmup",
    )
    p.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="1, or spawned gloo ranks saving one state together, each its share (size / ranks); "
        "per round the slower rank's stall of each contender",
    )
    p.add_argument(
        "--fixed-order",
        action="store_true",
        help="tierckpt always first after the memcpy floor (the order before rounds alternated)",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/stall.json"))
    p.add_argument("--smoke", action="store_true", help="16 MiB, 3 rounds (CI)")
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.iters, args.warmup, args.interval = "16", 3, 1, 0.0
    args.size_list = [int(s) for s in args.sizes.split(",") if s]
    if args.ranks < 1:
        p.error("--ranks must be at least 1")
    if not 1 <= args.warmup < args.iters:
        p.error(f"--iters ({args.iters}) must exceed --warmup ({args.warmup}), which must be >= 1")
    return args


def mem_available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def proc_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class Phases:
    """Wall time spent in chosen functions during one save (wrapped for the run)."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self._undo: list[Callable[[], None]] = []
        self._stage_thread: int | None = None  # set while the trainer thread is in stage()

    def wrap(self, owner: Any, name: str, key: str, outside: str | None = None) -> None:
        """Time ``owner.name`` under ``key``; calls from outside ``stage`` (the background
        thread) under ``outside`` instead, if given."""
        orig = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            inside = self._stage_thread == threading.get_ident()
            name_ = key if outside is None or inside else outside
            if key == "stage":
                self._stage_thread = threading.get_ident()
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.t[name_] = self.t.get(name_, 0.0) + time.perf_counter() - t0
                if key == "stage":
                    self._stage_thread = None

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, orig))

    def undo(self) -> None:
        for u in reversed(self._undo):
            u()


class _ReusedStager(DefaultStager):
    """``DefaultStager``, reused on every torch: 2.11 closes its ``StateDictStager`` after every
    stage, which drops its cached storages and clears its deepcopy table (the second stage of a
    state holding a class then fails with a KeyError on ``type``); 2.13 keeps it open until
    ``close``, as this does."""

    def __init__(self, options: StagingOptions) -> None:
        super().__init__(options)
        inner: Any = self._state_dict_stager
        self._close_inner = inner.close
        inner.close = lambda: None

    def close(self) -> None:
        super().close()
        self._close_inner()


def state(size_mb: int, n_tensors: int = N_TENSORS, rank: int | None = None) -> dict[str, Any]:
    """``size_mb`` of float32 in ``n_tensors``; with ``rank``, named for that rank alone (each
    rank's tensors are its own items: the same name on two ranks would be saved once)."""
    prefix = "" if rank is None else f"r{rank}."
    # Nested under one key, as a model's state is: DCP's async_save wraps every top-level key in
    # its method logger (~0.3 ms each here), a cost of the state's shape, not of the stager.
    name = prefix + "w{i:05d}"
    model = harness.make_state(size_mb, n_tensors, name=name, seed=rank or 0)
    return {"model": model, "extra": {"step": 0, "tag": "stall"}}


def tensors(sd: dict[str, Any]) -> list[torch.Tensor]:
    return list(sd["model"].values())


def run_size(size_mb: int, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """One daemon; the rounds on this process (1 rank) or on ``--ranks`` spawned gloo ranks."""
    shm = root / f"tier-{size_mb}"
    capacity = (KEEP_LAST + 2) * size_mb * (2 if args.before else 1) + 256
    log = root / f"daemon-{size_mb}.log"
    daemon = harness.start_daemon(capacity, keep_last=KEEP_LAST, shm_dir=shm, log_path=log)
    assert daemon.proc is not None
    out = root / f"rounds-{size_mb}.txt"
    try:
        if args.ranks > 1:
            import torch.multiprocessing as mp

            port = free_port()
            job = (args.ranks, port, size_mb, args, root, daemon.proc.pid, str(out))
            mp.spawn(run_rank, args=job, nprocs=args.ranks)
        else:
            run_rank(0, 1, 0, size_mb, args, root, daemon.proc.pid, str(out))
        per_rank, cpu = ast.literal_eval(out.read_text())
    finally:
        daemon.stop(timeout=10)
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(root / f"fs-{size_mb}", ignore_errors=True)
    return summarize(per_rank, cpu, args, size_mb)


def run_rank(
    rank: int,
    world: int,
    port: int,
    size_mb: int,
    args: argparse.Namespace,
    root: Path,
    daemon_pid: int,
    out: str,
) -> None:
    """This rank's rounds; rank 0 writes every rank's rows (and the CPU-seconds) to ``out``."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if world > 1:
        # DCP's helper process (PROCESS mode) puts its own store on MASTER_ADDR: loopback.
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows, cpu = rounds(rank, world, size_mb, args, root, daemon_pid)
        every: list[Any] = [(rows, cpu)]
        if world > 1:
            every = [None] * world
            dist.all_gather_object(every, (rows, cpu))
        if rank == 0:
            total = {k: sum(c[k] for _, c in every) for k in cpu}  # all ranks' CPU
            Path(out).write_text(repr(([r for r, _ in every], total)))
    finally:
        if world > 1:
            dist.destroy_process_group()


def rounds(
    rank: int, world: int, size_mb: int, args: argparse.Namespace, root: Path, daemon_pid: int
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """``--iters`` rounds of memcpy, tierckpt's and torch's ``async_save``, between barriers
    when there are several ranks (each saves its share, ``size / ranks``, of the state)."""
    fs_root = root / f"fs-{size_mb}"
    sync = dist.barrier if world > 1 else (lambda: None)
    collective: dict[str, Any] = {} if world > 1 else {"no_dist": True}
    off = ClientConfig.from_env(prelease=False)
    sd = state(size_mb // world, args.tensors, rank if world > 1 else None)
    dst = [torch.empty_like(t).fill_(0) for t in tensors(sd)]
    stager = _ReusedStager(
        StagingOptions(
            use_pinned_memory=False,
            use_shared_memory=args.mode == "process",
            use_async_staging=False,
            use_non_blocking_copy=False,
        )
    )
    kind = AsyncCheckpointerType.PROCESS if args.mode == "process" else AsyncCheckpointerType.THREAD
    ph = Phases()
    ph.wrap(writer_module, "staging_size", "size_walk")
    ph.wrap(writer_module, "stage_into", "copy")
    ph.wrap(DaemonClient, "lease", "lease_round_trip", outside="background_lease")
    ph.wrap(_prelease, "claim", "prelease_claim")
    ph.wrap(_arena, "map_file", "map_file", outside="background_map_file")
    ph.wrap(writer_module.TieredStorageWriter, "stage", "stage")
    ph.wrap(StateDictStager, "stage", "torch_copy")
    rows: list[dict[str, Any]] = []
    cpu = {"tier_self": 0.0, "tier_daemon": 0.0, "torch_self": 0.0}
    if world == 1 and args.mode == "process":  # DCP's helper process joins the trainer's group
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        for i in range(args.iters):
            if i:
                time.sleep(args.interval)
            for t in tensors(sd):
                t[0] += 1
            sd["extra"]["step"] = i
            sync()
            t0 = time.perf_counter()
            for d, s in zip(dst, tensors(sd), strict=True):
                d.copy_(s)
            memcpy = time.perf_counter() - t0

            def tierckpt_save(i: int = i) -> tuple[float, dict[str, float], float | None, Any]:
                ph.t = {}
                sync()
                c0, d0 = self_cpu_s(), proc_cpu_s(daemon_pid) if rank == 0 else 0.0
                writer = writer_module.TieredStorageWriter("stall", step=i + 1)
                t0 = time.perf_counter()
                fut = dcp.async_save(
                    sd, storage_writer=writer, async_checkpointer_type=kind, **collective
                )
                tier = time.perf_counter() - t0
                fut.result()
                if i >= args.warmup:
                    cpu["tier_self"] += self_cpu_s() - c0
                    if rank == 0:
                        cpu["tier_daemon"] += proc_cpu_s(daemon_pid) - d0
                phases = dict(ph.t)
                phases["async_save_rest"] = tier - phases.get("stage", 0.0)

                before = before_phases = None
                if args.before:  # the same writer with pre-leases off, in its own namespace
                    ph.t = {}
                    sync()
                    writer = writer_module.TieredStorageWriter(
                        "stall-before", step=i + 1, config=off
                    )
                    t0 = time.perf_counter()
                    fut = dcp.async_save(
                        sd, storage_writer=writer, async_checkpointer_type=kind, **collective
                    )
                    before = time.perf_counter() - t0
                    fut.result()
                    before_phases = dict(ph.t)
                    before_phases["async_save_rest"] = before - before_phases.get("stage", 0.0)

                return tier, phases, before, before_phases

            def torch_save(i: int = i) -> tuple[float, float]:
                ph.t = {}
                sync()
                c0 = self_cpu_s()
                fs_writer = FileSystemWriter(fs_root / f"step_{i}")
                t0 = time.perf_counter()
                fut = dcp.async_save(
                    sd,
                    storage_writer=fs_writer,
                    async_stager=stager,
                    async_checkpointer_type=kind,
                    **collective,
                )
                torch_stall = time.perf_counter() - t0
                fut.result()
                torch_copy = ph.t.get("torch_copy", 0.0)
                if i >= args.warmup:
                    cpu["torch_self"] += self_cpu_s() - c0
                return torch_stall, torch_copy

            # Each contender right after the memcpy floor in every other round: the floor's
            # copy_ leaves torch's OpenMP workers spinning for milliseconds, which taxes
            # whatever runs next on a machine with few cores (see _byte_copy).
            if args.fixed_order or i % 2 == 0:
                tier, phases, before, before_phases = tierckpt_save()
                torch_stall, torch_copy = torch_save()
            else:
                torch_stall, torch_copy = torch_save()
                tier, phases, before, before_phases = tierckpt_save()
            sync()
            if rank == 0:
                shutil.rmtree(fs_root / f"step_{i}", ignore_errors=True)
            row: dict[str, Any] = {
                "memcpy_ms": memcpy * 1e3,
                "tier_ms": tier * 1e3,
                "torch_ms": torch_stall * 1e3,
                # The stall outside the copy (the copy's own time swings most with load).
                "tier_fixed_ms": (tier - phases.get("copy", 0.0)) * 1e3,
                "torch_fixed_ms": (torch_stall - torch_copy) * 1e3,
                "claimed": "prelease_claim" in phases and "lease_round_trip" not in phases,
                "phases_ms": {k: v * 1e3 for k, v in phases.items()},
            }
            if before is not None and before_phases is not None:
                row["before_ms"] = before * 1e3
                row["before_fixed_ms"] = (before - before_phases.get("copy", 0.0)) * 1e3
                row["before_phases_ms"] = {k: v * 1e3 for k, v in before_phases.items()}
            rows.append(row)
            if rank == 0:
                print(
                    f"  {size_mb} MiB round {i}: memcpy {memcpy * 1e3:.1f} ms, tierckpt "
                    f"{tier * 1e3:.1f} ms, torch {torch_stall * 1e3:.1f} ms"
                    + (f", before {before * 1e3:.1f} ms" if before is not None else "")
                    + ", phases "
                    + " ".join(f"{k}={v * 1e3:.2f}" for k, v in phases.items())
                    + (" (rank 0)" if world > 1 else ""),
                    flush=True,
                )
    finally:
        ph.undo()
        stager.close()
        if world == 1 and args.mode == "process":
            dist.destroy_process_group()
    n = max(1, args.iters - args.warmup)
    return rows, {k: v / n for k, v in cpu.items()}  # per save


def slowest(per_rank: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per round, each contender's time on its slower rank (the job goes on when every rank
    has): the memcpy and torch's stall the largest over the ranks, tierckpt's stall and its
    phases from the rank where it was largest."""
    if len(per_rank) == 1:
        return per_rank[0]
    out = []
    for ranks in zip(*per_rank, strict=True):
        row = dict(max(ranks, key=lambda r: r["tier_ms"]))
        row["memcpy_ms"] = max(r["memcpy_ms"] for r in ranks)
        slow = max(ranks, key=lambda r: r["torch_ms"])
        row["torch_ms"], row["torch_fixed_ms"] = slow["torch_ms"], slow["torch_fixed_ms"]
        row["claimed"] = all(r["claimed"] for r in ranks)
        if "before_ms" in row:
            b = max(ranks, key=lambda r: r["before_ms"])
            for k in ("before_ms", "before_fixed_ms", "before_phases_ms"):
                row[k] = b[k]
        out.append(row)
    return out


def summarize(
    per_rank: list[list[dict[str, Any]]],
    cpu: dict[str, float],
    args: argparse.Namespace,
    size_mb: int,
) -> dict[str, Any]:
    rows = slowest(per_rank)
    steady = rows[args.warmup :]
    n = len(steady)

    def med(key: str) -> float:
        return statistics.median(r[key] for r in steady)

    ratios = [r["tier_ms"] / r["torch_ms"] for r in steady]
    extra: dict[str, Any] = {}
    if args.before:
        b_keys = sorted({k for r in steady for k in r["before_phases_ms"]})
        extra = {
            "before_stall_ms": med("before_ms"),
            "before_fixed_ms": med("before_fixed_ms"),
            "before_fixed_best_ms": min(r["before_fixed_ms"] for r in steady),
            "before_stall_minus_memcpy_ms": statistics.median(
                r["before_ms"] - r["memcpy_ms"] for r in steady
            ),
            "ratio_before_over_torch": statistics.median(
                r["before_ms"] / r["torch_ms"] for r in steady
            ),
            "before_phases_ms": {
                k: statistics.median(r["before_phases_ms"].get(k, 0.0) for r in steady)
                for k in b_keys
            },
        }
    phase_keys = sorted({k for r in steady for k in r["phases_ms"]})
    # What the trainer waits for (stage's parts and the rest of async_save), then what runs in
    # the background thread (not in the stall).
    return {
        "bytes": size_mb
        // args.ranks
        * (1 << 20)
        // args.tensors
        // 4
        * 4
        * args.tensors
        * args.ranks,
        "ranks": args.ranks,
        "tier_stall_ms": med("tier_ms"),
        "torch_stall_ms": med("torch_ms"),
        "memcpy_ms": med("memcpy_ms"),
        "ratio_tier_over_torch": statistics.median(ratios),
        "ratio_tier_over_torch_best": min(ratios),
        "tier_stall_best_ms": min(r["tier_ms"] for r in steady),
        "torch_stall_best_ms": min(r["torch_ms"] for r in steady),
        "tier_stall_minus_memcpy_ms": statistics.median(
            r["tier_ms"] - r["memcpy_ms"] for r in steady
        ),
        "torch_stall_minus_memcpy_ms": statistics.median(
            r["torch_ms"] - r["memcpy_ms"] for r in steady
        ),
        "tier_fixed_ms": med("tier_fixed_ms"),
        "torch_fixed_ms": med("torch_fixed_ms"),
        "tier_fixed_best_ms": min(r["tier_fixed_ms"] for r in steady),
        "torch_fixed_best_ms": min(r["torch_fixed_ms"] for r in steady),
        "phases_ms": {
            k: statistics.median(r["phases_ms"].get(k, 0.0) for r in steady) for k in phase_keys
        },
        "prelease_claimed": sum(1 for r in steady if r["claimed"]),
        "steady_rounds": n,
        "cpu_s": cpu,  # per save, all ranks
        **extra,
        "rounds": rows,
        **({"rank_rounds": per_rank} if len(per_rank) > 1 else {}),
    }


def render(sizes: dict[str, Any]) -> str:
    lines = [
        "| MiB | memcpy ms | tierckpt stall ms | torch best-stager stall ms | tierckpt/torch "
        "(best) | tierckpt - memcpy ms | torch - memcpy ms | pre-lease used |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, r in sizes.items():
        if "skipped" in r:
            lines.append(f"| {size} | {r['skipped']} |")
            continue
        lines.append(
            f"| {size} | {r['memcpy_ms']:.1f} | {r['tier_stall_ms']:.1f} | "
            f"{r['torch_stall_ms']:.1f} | {r['ratio_tier_over_torch']:.2f} "
            f"({r['ratio_tier_over_torch_best']:.2f}) | {r['tier_stall_minus_memcpy_ms']:.1f} | "
            f"{r['torch_stall_minus_memcpy_ms']:.1f} | {r['prelease_claimed']}/{r['steady_rounds']} |"
        )
    lines += ["", "stall outside the copy (median / best ms): tierckpt, torch, pre-leases off"]
    for size, r in sizes.items():
        if "tier_fixed_ms" in r:
            before = (
                f", {r['before_fixed_ms']:.2f} / {r['before_fixed_best_ms']:.2f}"
                if "before_fixed_ms" in r
                else ""
            )
            lines.append(
                f"  {size} MiB: {r['tier_fixed_ms']:.2f} / {r['tier_fixed_best_ms']:.2f}, "
                f"{r['torch_fixed_ms']:.2f} / {r['torch_fixed_best_ms']:.2f}{before}"
            )
    lines += ["", "tierckpt phases (median ms per save):"]
    for size, r in sizes.items():
        for key, label in (("phases_ms", ""), ("before_phases_ms", " (pre-leases off)")):
            if key in r:
                lines.append(
                    f"  {size} MiB{label}: " + ", ".join(f"{k} {v:.2f}" for k, v in r[key].items())
                )
        if "before_stall_ms" in r:
            lines.append(
                f"  {size} MiB pre-leases off: stall {r['before_stall_ms']:.1f} ms, - memcpy "
                f"{r['before_stall_minus_memcpy_ms']:.1f} ms, / torch "
                f"{r['ratio_before_over_torch']:.2f}"
            )
    return "\n".join(lines)


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """The suite's run: at ``--stall-sizes``."""
    if args.no_stall:
        notes.append("stall against torch's best stager skipped (--no-stall)")
        return None
    cmd = ["--smoke"] if args.smoke else ["--sizes", args.stall_sizes]
    what = "stall vs torch's reused DefaultStager"
    d = child_results("stall.py", cmd, tmp / "stall.json", what, notes, "stall scenario")
    return None if d is None else dict(d["results"]["sizes"])


def rows(res: dict[str, Any]) -> list[Row]:
    """Issue 15 goal 3: the stall at or below torch's reused DefaultStager, and stall - memcpy."""
    st = res.get("stall") or {}
    out: list[Row] = []
    for size, r in st.items():
        if "skipped" in r:
            out.append(
                (f"{size} MiB", "stall vs torch's best stager", "skipped", "", r["skipped"], "", "")
            )
            continue
        v = r["ratio_tier_over_torch"]
        out.append(
            (
                f"{size} MiB",
                "tierckpt stall (torch's reused DefaultStager)",
                f"{r['tier_stall_ms']:.1f} ms ({r['torch_stall_ms']:.1f})",
                "",
                f"{v:.2f}x torch (best {r['ratio_tier_over_torch_best']:.2f}); stall - memcpy "
                f"{r['tier_stall_minus_memcpy_ms']:.1f} ms (torch "
                f"{r['torch_stall_minus_memcpy_ms']:.1f})",
                "<= 1",
                yes(v <= 1.0),
            )
        )
    return out


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = Path("/dev/shm") / f"tierckpt-bench-stall-{uuid.uuid4().hex[:8]}"
    info = machine_info(
        iters=args.iters,
        warmup=args.warmup,
        tensors=args.tensors,
        mode=args.mode,
        ranks=args.ranks,
        loadavg=os.getloadavg(),
    )
    sizes: dict[str, Any] = {}
    try:
        for size in args.size_list:
            # The state, the memcpy target, torch's cached copy and KEEP_LAST + 2 tier files.
            need = (KEEP_LAST + 5 + (KEEP_LAST + 1 if args.before else 0)) * size + 1024
            if mem_available_mib() < need:
                sizes[str(size)] = {
                    "skipped": f"needs ~{need} MiB, {mem_available_mib()} available"
                }
                print(f"{size} MiB skipped: {sizes[str(size)]['skipped']}")
                continue
            _prelease.forget_all()
            sizes[str(size)] = run_size(size, args, root)
    except BaseException:
        for log in root.glob("daemon-*.log"):
            print(f"{log.name} (tail):\n{log.read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / root.name, ignore_errors=True)
    info["loadavg_after"] = os.getloadavg()
    print(render(sizes))
    write_results(args.out, info, {"sizes": sizes})


if __name__ == "__main__":
    main()
