"""Peers benchmark (issue 35): tierckpt beside the in-memory checkpointers it is compared with.

One process (``--ranks 1``, the default), one CPU state dict of 16 float32 tensors (``--tensors``) per size
(``--sizes``, MiB), ``--iters`` rounds, interleaved: every round first times a memcpy of the state into pre-touched tensors (the
paired floor), then each contender saves the state (in an order that rotates from round to round),
then each restores its save into zeroed tensors (same rotation), and every restore is checked
bit-exact against the state. ``--ranks N`` (``_peers_ranks.py``): the same rounds in N spawned
ranks on one gloo group (one node, one daemon per tierckpt contender shared by the ranks), each
rank with its own 1/N of the state (its own keys and values, as FSDP shards a model), a barrier
before each timed call, every restore checked on every rank, and each figure the slowest rank's.
Contenders (``_peers_contenders.py``), each used the way its documentation shows:

- ``tierckpt``: ``dcp.async_save`` with ``TieredStorageWriter`` (THREAD) into a real daemon (on
  the default process group with several ranks: the plan and the commit across ranks);
  restore ``dcp.load`` with ``TieredStorageReader``, verified (the default) and, beside it, with
  ``TIERCKPT_VERIFY_READS=0`` (``tierckpt_unverified``: the same save, read without the check).
- ``tierckpt_ckpt``: the same through ``Checkpointer(async_staging=False).save`` (THREAD: the
  state staged on this thread, then ``dcp.save`` on the Checkpointer's one long-lived thread);
  complete at ``wait()``; restore by ``Checkpointer.restore`` ("latest", verified).
- ``torch``: ``dcp.async_save`` with one reused ``DefaultStager`` (synchronous, not pinned: its
  fastest honest CPU setting, as in ``stall.py``) and ``FileSystemWriter`` into /dev/shm; restore
  ``dcp.load`` with ``FileSystemReader``.
- ``dlrover``: DLRover Flash Checkpoint, ``DdpCheckpointer(dir).save_checkpoint(step, sd,
  storage_type=StorageType.MEMORY)`` (synchronous: the copy into its shared-memory segment is the
  whole save) and ``load_checkpoint()`` (views into the segment), copied into the tensors as
  ``load_state_dict`` would. Its saver runs as a child of this process (of rank 0; no
  ``dlrover-run``). With N ranks ``local_shard_num`` = ``global_shard_num`` = N (its setting for
  a state partitioned on all ranks): each rank copies its shard into a segment of its own.
- ``gemini``: LM Resiliency's ``InMemoryCheckpointManager.save(sd, step)`` (returns after its
  host copy on CPU; ``maybe_wait`` completes it) and ``load()`` (clones of its slot), copied into
  the tensors. One rank: no peer replication. With N ranks each rank's copy is replicated to its
  peer rank over Gloo (its real mode): complete when ``finalize_replication()`` says it landed.
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
from _peers_contenders import ORDER, build_peers, nvrx_reason, one_round, round_line, why_absent
from _peers_ranks import MAX_RANKS, rank_rows
from harness import Row, child_results, machine_info, make_state, write_results

N_TENSORS = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="64,1024", help="state sizes in MiB, comma-separated")
    p.add_argument("--iters", type=int, default=10, help="rounds per size (> --warmup)")
    p.add_argument("--warmup", type=int, default=2, help="leading rounds left out")
    p.add_argument("--interval", type=float, default=0.3, help="seconds between rounds")
    p.add_argument("--peers", default=",".join(ORDER), help="contenders, comma-separated")
    p.add_argument("--out", type=Path, default=Path("bench/results/peers.json"))
    p.add_argument("--md", type=Path, help="also write the markdown table here")
    p.add_argument("--smoke", action="store_true", help="8 MiB, 3 rounds (CI)")
    p.add_argument(
        "--ranks", type=int, default=1, help="ranks on this node, each with 1/N of the state"
    )
    p.add_argument(
        "--tensors",
        type=int,
        default=N_TENSORS,
        help="float32 tensors in the state (in all ranks), of equal size",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.sizes, args.iters, args.warmup, args.interval = "8", 3, 1, 0.0
    try:
        args.size_list = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        p.error(f"--sizes {args.sizes!r}: MiB as whole numbers, comma-separated")
    if not args.size_list or min(args.size_list) < 1:
        p.error(f"--sizes {args.sizes!r}: at least one size, each >= 1 MiB")
    if args.tensors < 1:
        p.error(f"--tensors {args.tensors}: at least 1")
    if not 1 <= args.ranks <= MAX_RANKS:
        p.error(f"--ranks {args.ranks}: 1 (one process) to {MAX_RANKS} (one node)")
    args.peer_list = [s for s in args.peers.split(",") if s]
    unknown = set(args.peer_list) - set(ORDER)
    if unknown:
        p.error(f"unknown peers {sorted(unknown)}; known: {', '.join(ORDER)}")
    if not 1 <= args.warmup < args.iters:
        p.error(f"--iters ({args.iters}) must exceed --warmup ({args.warmup}), which must be >= 1")
    return args


def summarize(rows: list[dict[str, float]], warmup: int) -> dict[str, Any]:
    """Medians over the rounds after ``warmup``, and medians of each paired ratio to memcpy."""
    steady = rows[warmup:]
    out: dict[str, Any] = {"memcpy_ms": statistics.median(r["memcpy"] for r in steady) * 1e3}
    for key in rows[0]:
        if key != "memcpy":
            out[f"{key}_ms"] = statistics.median(r[key] for r in steady) * 1e3
            out[f"{key}_over_memcpy"] = statistics.median(r[key] / r["memcpy"] for r in steady)
    out["rounds_ms"] = [{k: v * 1e3 for k, v in r.items()} for r in rows]
    return out


def run_size(
    size_mb: int, args: argparse.Namespace, names: list[str], root: Path
) -> list[dict[str, float]]:
    """Each round's seconds by key, in this process (``--ranks 1``)."""
    sd = make_state(size_mb, args.tensors)
    memcpy_dst = {k: torch.empty_like(v).fill_(0) for k, v in sd.items()}
    dst = {k: torch.empty_like(v).fill_(0) for k, v in sd.items()}
    peers: list[Any] = []
    rows: list[dict[str, float]] = []
    try:
        build_peers(peers, names, root, size_mb, {})
        for i in range(args.iters):
            if i:
                time.sleep(args.interval)
            rows.append(one_round(i, sd, (memcpy_dst, dst), peers))
            print(round_line(size_mb, i, rows[-1]), flush=True)
    finally:
        for p in peers:
            p.close()
    return rows


def render(sizes: dict[str, Any], names: list[str], skipped: list[str], ranks: int = 1) -> str:
    cols = list(names)
    of = f", each the slowest of {ranks} ranks" if ranks > 1 else ""
    lines = [
        f"Medians in ms (x the same rounds' memcpy{of}):",
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
    """The suite's run (its default sizes), in one process and then, but for ``--smoke``, in 2
    ranks (``two_ranks`` in the results); the contenders it could not run go to the notes."""
    if args.no_peers:
        notes.append("peers skipped (--no-peers)")
        return None
    cmd = ["--smoke"] if args.smoke else []
    what = "beside DLRover, GEMINI and torch's stager"
    d = child_results("peers.py", cmd, tmp / "peers.json", what, notes, "peers")
    two: Any = None  # (its JSON)
    if args.smoke:  # 18-30 s more on a loaded 2-core box: run it as `peers.py --smoke --ranks 2`
        notes.append("peers in 2 ranks: not in the smoke (bench/peers.py --smoke --ranks 2)")
    else:
        out2 = tmp / "peers2.json"
        two = child_results("peers.py", ["--ranks", "2"], out2, f"{what}, 2 ranks", notes)
    if d is None and two is None:
        return None
    res = dict(d["results"]) if d is not None else {}
    if two is not None:
        res["two_ranks"] = two["results"]
    notes += (d or two)["results"]["skipped"]
    return res


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
        iters=args.iters,
        warmup=args.warmup,
        tensors=args.tensors,
        ranks=args.ranks,
        loadavg=os.getloadavg(),
    )
    sizes: dict[str, Any] = {}
    root = Path("/dev/shm") / f"tierckpt-bench-peers-{uuid.uuid4().hex[:8]}"
    try:
        for size in args.size_list:
            sub = root / str(size)
            sub.mkdir(parents=True)
            try:
                rounds = (run_size if args.ranks == 1 else rank_rows)(size, args, names, sub)
                sizes[str(size)] = summarize(rounds, args.warmup)
            except BaseException:
                for log in sub.glob("*/daemon.log"):
                    print(f"{log} (tail):\n{log.read_text()[-3000:]}", file=sys.stderr)
                raise
            finally:
                shutil.rmtree(sub, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(Path(tempfile.gettempdir()) / root.name, ignore_errors=True)
    info["loadavg_after"] = os.getloadavg()
    table = render(sizes, names, skipped, args.ranks)
    print(table)
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(table + "\n")
    res = {"sizes": sizes, "peers": names, "skipped": skipped, "ranks": args.ranks}
    write_results(args.out, info, res)


if __name__ == "__main__":
    main()
