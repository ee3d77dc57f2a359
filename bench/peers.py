"""Peers benchmark (issue 35): tierckpt beside the in-memory checkpointers it is compared with.

One process, one CPU state dict of 16 float32 tensors per size (``--sizes``, MiB), ``--iters``
rounds, interleaved: every round first times a memcpy of the state into pre-touched tensors (the
paired floor), then each contender saves the state (in an order that rotates from round to round),
then each restores its save into zeroed tensors (same rotation), and every restore is checked
bit-exact against the state. Contenders, each used the way its documentation shows:

- ``tierckpt``: ``dcp.async_save`` with ``TieredStorageWriter`` (THREAD) into a real daemon;
  restore ``dcp.load`` with ``TieredStorageReader``, verified (the default) and, beside it, with
  ``TIERCKPT_VERIFY_READS=0`` (``tierckpt_unverified``: the same save, read without the check).
- ``tierckpt_ckpt``: the same through ``Checkpointer(async_staging=False).save`` (THREAD: the
  state staged on this thread, then ``dcp.save`` on the Checkpointer's one long-lived thread);
  complete at ``wait()``; restore as ``tierckpt``'s, verified.
- ``torch``: ``dcp.async_save`` with one reused ``DefaultStager`` (synchronous, not pinned: its
  fastest honest CPU setting, as in ``stall.py``) and ``FileSystemWriter`` into /dev/shm; restore
  ``dcp.load`` with ``FileSystemReader``.
- ``dlrover``: DLRover Flash Checkpoint, ``DdpCheckpointer(dir).save_checkpoint(step, sd,
  storage_type=StorageType.MEMORY)`` (synchronous: the copy into its shared-memory segment is the
  whole save) and ``load_checkpoint()`` (views into the segment), copied into the tensors as
  ``load_state_dict`` would. Its saver runs as a child of this process (no ``dlrover-run``).
- ``gemini``: LM Resiliency's ``InMemoryCheckpointManager.save(sd, step)`` (returns after its
  host copy on CPU; ``maybe_wait`` completes it) and ``load()`` (clones of its slot), copied into
  the tensors. One rank: no peer replication (it replicates to a peer rank over Gloo).
- ``nvrx``: nvidia-resiliency-ext's local checkpoints need CUDA tensors (and Python 3.12): skipped
  with that reason on a CPU-only host.

A peer that is not installed is skipped with a line saying why. Reported per size: each
contender's stall (the save call's return), time until its checkpoint is complete, and restore
from memory (into the tensors, checked), as medians over the rounds after ``--warmup``, and the
median over rounds of each paired ratio to that round's memcpy. JSON to ``--out``, the markdown
table to ``--md`` (and stdout).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from harness import (
    Row,
    check_equal,
    child_results,
    machine_info,
    make_state,
    start_daemon,
    write_results,
)
from stall import _ReusedStager
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import StagingOptions
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.checkpointer import Checkpointer
from tierckpt_client.config import ClientConfig
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

N_TENSORS = 16
KEEP_LAST = 2
ORDER = ("tierckpt", "tierckpt_ckpt", "torch", "dlrover", "gemini")
THREAD = AsyncCheckpointerType.THREAD


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,1024", help="state sizes in MiB, comma-separated")
    p.add_argument("--iters", type=int, default=10, help="rounds per size (> --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="leading rounds left out")
    p.add_argument("--interval", type=float, default=0.3, help="seconds between rounds")
    p.add_argument("--peers", default=",".join(ORDER), help="contenders, comma-separated")
    p.add_argument("--out", type=Path, default=Path("bench/results/peers.json"))
    p.add_argument("--md", type=Path, help="also write the markdown table here")
    p.add_argument("--smoke", action="store_true", help="8 MiB, 3 rounds (CI)")
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.iters, args.warmup, args.interval = "8", 3, 1, 0.0
    args.size_list = [int(s) for s in args.sizes.split(",") if s]
    args.peer_list = [s for s in args.peers.split(",") if s]
    unknown = set(args.peer_list) - set(ORDER)
    if unknown:
        p.error(f"unknown peers {sorted(unknown)}; known: {', '.join(ORDER)}")
    if not 1 <= args.warmup < args.iters:
        p.error(f"--iters ({args.iters}) must exceed --warmup ({args.warmup}), which must be >= 1")
    return args


def copy_into(dst: dict[str, torch.Tensor], src: dict[str, Any]) -> None:
    for k, d in dst.items():
        d.copy_(src[k])


class Tierckpt:
    """``async_save`` through a real daemon; restores verified and unverified."""

    name = "tierckpt"
    namespace = "peers"

    def __init__(self, root: Path, size_mb: int) -> None:
        capacity = (KEEP_LAST + 2) * size_mb + 256
        self.daemon = start_daemon(
            capacity, keep_last=KEEP_LAST, shm_dir=root / "tier", log_path=root / "daemon.log"
        )
        self.on = ClientConfig.from_env()
        self.off = ClientConfig.from_env(verify_reads=False)
        self.step = 0

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        self.step = step
        writer = TieredStorageWriter(self.namespace, step=step, config=self.on)
        t0 = time.perf_counter()
        fut = dcp.async_save(
            sd, storage_writer=writer, async_checkpointer_type=THREAD, no_dist=True
        )
        stall = time.perf_counter() - t0
        fut.result()
        return stall, time.perf_counter() - t0

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        reader = TieredStorageReader(
            self.namespace, step=self.step, config=self.on if verified else self.off
        )
        t0 = time.perf_counter()
        dcp.load(dst, storage_reader=reader, no_dist=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.daemon.stop(timeout=10)


class TierckptCheckpointer(Tierckpt):
    """``Checkpointer.save`` (THREAD, staged synchronously) through a real daemon of its own."""

    name = "tierckpt_ckpt"
    namespace = "peers-ckpt"

    def __init__(self, root: Path, size_mb: int) -> None:
        super().__init__(root / self.name, size_mb)
        self.ckpt = Checkpointer(
            self.namespace, async_staging=False, handle_signals=False, config=self.on
        )

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        self.step = step
        t0 = time.perf_counter()
        self.ckpt.save(step, sd)
        stall = time.perf_counter() - t0
        self.ckpt.wait()
        return stall, time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.ckpt.close()
        finally:
            super().close()


class TorchBest:
    """torch DCP with one reused ``DefaultStager`` into /dev/shm files."""

    name = "torch"

    def __init__(self, root: Path, size_mb: int) -> None:
        self.root = root / "torch"
        self.stager = _ReusedStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
        )
        self.path: Path | None = None

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        old, self.path = self.path, self.root / f"step_{step}"
        t0 = time.perf_counter()
        fut = dcp.async_save(
            sd,
            storage_writer=FileSystemWriter(self.path),
            async_stager=self.stager,
            async_checkpointer_type=THREAD,
            no_dist=True,
        )
        stall = time.perf_counter() - t0
        fut.result()
        done = time.perf_counter() - t0
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return stall, done

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        assert self.path is not None
        t0 = time.perf_counter()
        dcp.load(dst, storage_reader=FileSystemReader(self.path), no_dist=True)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.stager.close()


class DLRover:
    """DLRover Flash Checkpoint's memory save (synchronous copy into its shm segment)."""

    name = "dlrover"

    def __init__(self, root: Path, size_mb: int) -> None:
        from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer

        self.memory = StorageType.MEMORY
        # Its shared-memory segment (one per local shard), which it leaves behind on exit.
        self.shm = Path("/dev/shm/ckpt_shm_0")
        if self.shm.exists():
            raise RuntimeError(f"dlrover: {self.shm} exists (another DLRover job on this host?)")
        self.ckpt = DdpCheckpointer(str(root / "dlrover"))

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.ckpt.save_checkpoint(step, sd, storage_type=self.memory)
        stall = time.perf_counter() - t0
        return stall, stall

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        t0 = time.perf_counter()
        copy_into(dst, self.ckpt.load_checkpoint())
        return time.perf_counter() - t0

    def close(self) -> None:
        engine = self.ckpt._engine
        engine.close()
        proc = getattr(engine, "saver_proc", None)
        if proc is not None and proc.is_alive():
            proc.terminate()
            proc.join(timeout=10)
        self.shm.unlink(missing_ok=True)


class Gemini:
    """LM Resiliency's ``InMemoryCheckpointManager`` (GEMINI), one rank: no peer replica."""

    name = "gemini"

    def __init__(self, root: Path, size_mb: int) -> None:
        from lm_resiliency.checkpointing import InMemoryCheckpointManager, InMemoryCkptConfig

        config = InMemoryCkptConfig(
            interval=1,
            disk_flush_interval=0,
            disk_folder=str(root / "gemini"),
            run_id="peers-bench",
            pin_memory=False,
        )
        self.mgr = InMemoryCheckpointManager(config)

    def save(self, sd: dict[str, torch.Tensor], step: int) -> tuple[float, float]:
        t0 = time.perf_counter()
        self.mgr.save(sd, step)
        stall = time.perf_counter() - t0
        self.mgr.maybe_wait()
        return stall, time.perf_counter() - t0

    def restore(self, dst: dict[str, torch.Tensor], verified: bool = True) -> float:
        t0 = time.perf_counter()
        loaded = self.mgr.load()
        if loaded is None:
            raise AssertionError("gemini: load() found no checkpoint in memory")
        copy_into(dst, loaded[0])
        return time.perf_counter() - t0

    def close(self) -> None:
        self.mgr.close()


PEERS: dict[str, type] = {
    c.name: c for c in (Tierckpt, TierckptCheckpointer, TorchBest, DLRover, Gemini)
}


def why_absent(name: str) -> str | None:
    """Why a peer cannot run in this environment, or None."""
    need = {"dlrover": ("dlrover", "grpc"), "gemini": ("lm_resiliency",)}.get(name, ())
    for mod in need:
        try:
            __import__(mod)
        except Exception as e:  # any import failure: the peer is absent
            return f"{name} skipped: `import {mod}` failed ({type(e).__name__}: {e})"
    return None


def nvrx_reason() -> str:
    try:
        import nvidia_resiliency_ext  # type: ignore[import-not-found]  # noqa: F401
    except Exception:
        return (
            "nvrx skipped: nvidia-resiliency-ext is not installed (its local checkpoints need CUDA)"
        )
    if not torch.cuda.is_available():
        return "nvrx skipped: its local checkpoints need CUDA tensors (no CUDA here)"
    return "nvrx skipped: this CPU benchmark does not run it (CUDA tensors; see gpu_staging.py)"


def run_size(size_mb: int, args: argparse.Namespace, names: list[str], root: Path) -> dict:
    sd = make_state(size_mb)
    memcpy_dst = {k: torch.empty_like(v).fill_(0) for k, v in sd.items()}
    dst = {k: torch.empty_like(v).fill_(0) for k, v in sd.items()}
    peers: list[Any] = []
    rows: list[dict[str, float]] = []
    try:
        # DLRover forks its saver when built: first, before the others start threads.
        for n in sorted(names, key=lambda n: n != "dlrover"):
            peers.append(PEERS[n](root, size_mb))  # (appended as built: closed if one fails)
        peers.sort(key=lambda p: names.index(p.name))
        for i in range(args.iters):
            if i:
                time.sleep(args.interval)
            for t in sd.values():
                t[0] += 1
            t0 = time.perf_counter()
            copy_into(memcpy_dst, sd)
            row = {"memcpy": time.perf_counter() - t0}
            order = peers[i % len(peers) :] + peers[: i % len(peers)]
            for p in order:
                row[f"{p.name}_stall"], row[f"{p.name}_done"] = p.save(sd, i + 1)
            for p in order:
                kinds = [True, False] if p.name == "tierckpt" else [True]
                for verified in kinds:
                    for d in dst.values():
                        d.zero_()
                    label = p.name if verified else f"{p.name}_unverified"
                    row[f"{label}_restore"] = p.restore(dst, verified)
                    check_equal(dst, sd, f"{label} round {i}")
            rows.append(row)
            print(
                f"  {size_mb} MiB round {i}: "
                + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in row.items())
                + " ms",
                flush=True,
            )
    finally:
        for p in peers:
            p.close()
    steady = rows[args.warmup :]
    out: dict[str, Any] = {"memcpy_ms": statistics.median(r["memcpy"] for r in steady) * 1e3}
    for key in rows[0]:
        if key != "memcpy":
            out[f"{key}_ms"] = statistics.median(r[key] for r in steady) * 1e3
            out[f"{key}_over_memcpy"] = statistics.median(r[key] / r["memcpy"] for r in steady)
    out["rounds_ms"] = [{k: v * 1e3 for k, v in r.items()} for r in rows]
    return out


def render(sizes: dict[str, Any], names: list[str], skipped: list[str]) -> str:
    cols = list(names)
    lines = [
        "Medians in ms (x the same rounds' memcpy):",
        "",
        "| | memcpy | " + " | ".join(cols) + " |",
        "|---|---:|" + "---:|" * len(cols),
    ]
    for what, label in (("stall", "stall"), ("done", "until complete"), ("restore", "restore")):
        for size, r in sizes.items():
            cells = []
            for n in cols:
                key = f"{n}_{what}"
                cell = f"{r[key + '_ms']:.1f} ({r[key + '_over_memcpy']:.2f}x)"
                if what == "restore" and n == "tierckpt":
                    u = "tierckpt_unverified_restore"
                    cell += f"; unverified {r[u + '_ms']:.1f} ({r[u + '_over_memcpy']:.2f}x)"
                cells.append(cell)
            lines.append(
                f"| {label}, {size} MiB | {r['memcpy_ms']:.1f} | " + " | ".join(cells) + " |"
            )
    lines += [""] + [f"- {s}" for s in skipped]
    return "\n".join(lines)


def run(args: argparse.Namespace, tmp: Path, notes: list[str]) -> dict[str, Any] | None:
    """The suite's run (its default sizes); the contenders it could not run go to the notes."""
    if args.no_peers:
        notes.append("peers skipped (--no-peers)")
        return None
    cmd = ["--smoke"] if args.smoke else []
    what = "beside DLRover, GEMINI and torch's stager"
    d = child_results("peers.py", cmd, tmp / "peers.json", what, notes, "peers")
    if d is None:
        return None
    notes += d["results"]["skipped"]
    return dict(d["results"])


def rows(res: dict[str, Any]) -> list[Row]:
    """None in the suite's table: its own table is in docs/benchmarks.md."""
    return []


def main() -> None:
    args = parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    names, skipped = [], []
    for name in args.peer_list:
        reason = why_absent(name)
        if reason is None:
            names.append(name)
        else:
            skipped.append(reason)
    skipped.append(nvrx_reason())
    for s in skipped:
        print(s)
    info = machine_info(
        iters=args.iters, warmup=args.warmup, tensors=N_TENSORS, ranks=1, loadavg=os.getloadavg()
    )
    sizes: dict[str, Any] = {}
    root = Path("/dev/shm") / f"tierckpt-bench-peers-{uuid.uuid4().hex[:8]}"
    try:
        for size in args.size_list:
            sub = root / str(size)
            sub.mkdir(parents=True)
            try:
                sizes[str(size)] = run_size(size, args, names, sub)
            except BaseException:
                log = sub / "daemon.log"
                if log.exists():
                    print(f"daemon log (tail):\n{log.read_text()[-3000:]}", file=sys.stderr)
                raise
            finally:
                shutil.rmtree(sub, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / root.name, ignore_errors=True)
    info["loadavg_after"] = os.getloadavg()
    table = render(sizes, names, skipped)
    print(table)
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table + "\n")
    write_results(args.out, info, {"sizes": sizes, "peers": names, "skipped": skipped})


if __name__ == "__main__":
    main()
