"""``peers.py --ranks N`` (N > 1): the same rounds in N spawned ranks on one gloo group.

One node: the parent starts the daemon of each tierckpt contender (its tmpfs dir under the
size's root), then spawns N ranks (``torch.multiprocessing``, gloo on loopback, a file://
rendezvous) with the environment torchrun gives a rank (``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` ...; ``TORCHELASTIC_RUN_ID`` names this run, so DLRover's
segments and sockets are this run's own). Each rank holds its own 1/N of ``--sizes`` (its own
keys ``r<rank>.w..``, its own values: sharded, as FSDP holds a model) and runs
:func:`_peers_contenders.one_round` with a barrier before each timed call; every restore is
checked bit-exact on every rank. A round's figure of each kind is the slowest rank's (gathered
over gloo after the round, untimed), and its ratio is to the slowest rank's memcpy of the same
round. Rank 0 writes the rounds to a JSON file that the parent reads.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _peers_contenders import Tierckpt, TierckptCheckpointer, build_peers, one_round, round_line
from harness import make_state

from tierckpt_core.launcher import DaemonProcess

MAX_RANKS = 8  # one node, every rank on this host's cores
# Contenders with a daemon of their own per node, started by the parent.
TIERCKPT: dict[str, type[Tierckpt]] = {c.name: c for c in (Tierckpt, TierckptCheckpointer)}
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # bound on any rank's wait for the others
SAVER_PID = "dlrover-saver.pid"  # DLRover's saver process, forked by rank 0: ended by the parent


def rank_rows(
    size_mb: int, args: argparse.Namespace, names: list[str], root: Path
) -> list[dict[str, float]]:
    """Each round's seconds by key (max over ``args.ranks`` ranks) at ``size_mb`` MiB in all."""
    daemons: dict[str, DaemonProcess] = {}
    run_id = f"peers-{root.parent.name}-{size_mb}"
    out = root / "rounds.json"
    try:
        for n in names:
            if n in TIERCKPT:
                daemons[n] = TIERCKPT[n].serve(root, size_mb)
        with tempfile.TemporaryDirectory(prefix="tierckpt-peers-ranks-") as tmp:
            job = (
                args.ranks,
                str(Path(tmp) / "store"),
                run_id,
                size_mb,
                names,
                {n: str(d.socket) for n, d in daemons.items()},
                str(root),
                (args.iters, args.interval),
                str(out),
                args.tensors,
            )
            mp.spawn(_rank, args=job, nprocs=args.ranks, join=True)
        return list(json.loads(out.read_text()))
    except BaseException:
        for n, d in daemons.items():
            print(f"{n}'s daemon log (tail):\n{d.log()}", file=sys.stderr)
        raise
    finally:
        _end_saver(root / SAVER_PID)
        for d in daemons.values():
            d.stop(timeout=10)
            d.cleanup()
        for seg in Path("/dev/shm").glob(f"{run_id}_ckpt_shm_*"):
            seg.unlink(missing_ok=True)
        shutil.rmtree(Path("/tmp/ckpt_sock") / run_id, ignore_errors=True)


def _end_saver(pid_file: Path) -> None:
    """DLRover's saver outlives a rank that was killed (it sleeps in a loop): end it. The file is
    gone if rank 0 ended it; the command line (a fork of a spawned rank) guards against a reused
    pid."""
    try:
        pid = int(pid_file.read_text())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ValueError):
        return
    if b"spawn_main" in cmdline:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


def _rank(
    rank: int,
    world: int,
    store: str,
    run_id: str,
    size_mb: int,
    names: list[str],
    sockets: dict[str, str],
    root: str,
    rounds: tuple[int, float],
    out: str,
    tensors: int,
) -> None:
    # What torchrun gives a rank on one node (DLRover reads LOCAL_RANK, LOCAL_WORLD_SIZE,
    # GROUP_*; its segments and sockets carry TORCHELASTIC_RUN_ID).
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        TORCHELASTIC_RUN_ID=run_id,
    )
    # Each rank an equal share of the node's cores for its intra-op threads, which size torch's
    # copies and tierckpt's alike (spawned ranks would each take all the cores: 2 ranks on 16
    # cores ran every torch copy, the memcpy baseline included, 30-40x slower).
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
    )
    peers: list[Any] = []
    saver = None
    try:
        half = make_state(size_mb / world, max(1, tensors // world), seed=rank)
        sd: dict[str, torch.Tensor] = {f"r{rank}.{k}": v for k, v in half.items()}
        dsts = (
            {k: torch.zeros_like(v) for k, v in sd.items()},
            {k: torch.zeros_like(v) for k, v in sd.items()},
        )
        build_peers(peers, names, Path(root), size_mb, sockets)
        saver = _note_saver(peers, Path(root) / SAVER_PID)
        iters, interval = rounds
        rows: list[dict[str, float]] = []
        for i in range(iters):
            if i:
                time.sleep(interval)
            mine = one_round(i, sd, dsts, peers, dist.barrier, f"rank {rank}: ")
            every: list[Any] = [None] * world
            dist.all_gather_object(every, mine)
            rows.append({k: max(r[k] for r in every) for k in mine})
            if rank == 0:
                print(f"{round_line(size_mb, i, rows[-1])} (max over {world} ranks)", flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps(rows))
        dist.barrier()
    finally:
        try:
            for p in peers:
                p.close()
            if saver is not None and not saver.is_alive():
                (Path(root) / SAVER_PID).unlink(missing_ok=True)
        finally:
            dist.destroy_process_group()


def _note_saver(peers: list[Any], pid_file: Path) -> Any:
    """DLRover's saver process (rank 0's), its pid written for the parent; else None."""
    for p in peers:
        proc = getattr(p, "saver", None)
        if proc is not None and proc.pid is not None:
            pid_file.write_text(str(proc.pid))
            return proc
    return None
