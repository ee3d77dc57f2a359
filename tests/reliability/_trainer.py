"""A training loop for the crash harness (tests/reliability/test_crash_consistency.py).

Each rank uses the daemon named by ``HARNESS_SOCKETS`` (comma-separated, one per rank), so the
ranks sit on one node or on two. At start the loop restores the newest step (DCP, every rank on
its own daemon), checks it bit-exact against what that step's save wrote, and prints
``resumed <step>`` (or ``MISMATCH ...`` and exits 3); then it saves step after step, alternating
``async_save`` (THREAD) and plain ``save``, and prints ``saved <step>`` once a save has returned:
a step the harness may hold the system to. Any error ends the run (exit 1), as a real job would
crash and be restarted. It runs until it is killed.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client import NamespaceNotFoundError, StepNotFoundError
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter


def rank_state(step: int, rank: int, numel: int) -> dict[str, Any]:
    """What ``rank`` saves at ``step``: its own tensors and bytes item, and the replicated ones."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    shared = torch.Generator().manual_seed(7_000_001 * step)
    return {
        f"rank{rank}": {
            "w": torch.randn(numel, generator=g),
            "ids": torch.randint(0, 1 << 30, (257,), generator=g, dtype=torch.int64),
            "note": f"rank {rank} at step {step}",
        },
        "shared": torch.randn(1024, generator=shared).to(torch.bfloat16),
        "extra": {"step": step},
    }


def template(ranks: list[int], numel: int) -> dict[str, Any]:
    """An empty state dict with the keys of ``ranks``' saves, to load into."""
    sd: dict[str, Any] = {
        "shared": torch.zeros(1024, dtype=torch.bfloat16),
        "extra": {"step": -1},
    }
    for r in ranks:
        sd[f"rank{r}"] = {
            "w": torch.zeros(numel),
            "ids": torch.zeros(257, dtype=torch.int64),
            "note": "",
        }
    return sd


def mismatch(loaded: dict[str, Any], step: int, ranks: list[int], numel: int) -> str | None:
    """What differs between ``loaded`` and what ``ranks`` saved at ``step`` (None: bit-exact)."""
    for r in ranks:
        want = rank_state(step, r, numel)
        got = loaded[f"rank{r}"]
        for key in ("w", "ids"):
            if not torch.equal(got[key].view(torch.uint8), want[f"rank{r}"][key].view(torch.uint8)):
                return f"rank{r}.{key} of step {step} differs"
        if got["note"] != want[f"rank{r}"]["note"]:
            return f"rank{r}.note of step {step} is {got['note']!r}"
        if not torch.equal(loaded["shared"].view(torch.uint8), want["shared"].view(torch.uint8)):
            return f"shared of step {step} differs"
    if loaded["extra"] != {"step": step}:
        return f"extra of step {step} is {loaded['extra']!r}"
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--namespace", required=True)
    p.add_argument("--numel", type=int, default=1 << 16)
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    os.environ["TIERCKPT_SOCKET"] = os.environ["HARNESS_SOCKETS"].split(",")[rank]
    group = dist.new_group(backend="gloo")

    start = 0
    probe = TieredStorageReader(args.namespace, process_group=group)
    try:
        probe.read_metadata()
    except (NamespaceNotFoundError, StepNotFoundError):
        pass
    else:
        start = probe.resolved_step or 0
        sd = template([rank], args.numel)
        dcp.load(
            sd,
            storage_reader=TieredStorageReader(args.namespace, start, process_group=group),
            process_group=group,
        )
        problem = mismatch(sd, start, [rank], args.numel)
        if problem:
            print(f"MISMATCH {problem}", flush=True)
            sys.exit(3)
    if rank == 0:
        print(f"resumed {start}", flush=True)
    step = start
    while True:
        step += 1
        sd = rank_state(step, rank, args.numel)
        writer = TieredStorageWriter(args.namespace, step)
        if step % 2:
            dcp.async_save(
                sd,
                storage_writer=writer,
                process_group=group,
                async_checkpointer_type=AsyncCheckpointerType.THREAD,
            ).result()
        else:
            dcp.save(sd, storage_writer=writer, process_group=group)
        if rank == 0:
            print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
