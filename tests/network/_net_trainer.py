"""A job with one rank per node for the network-fault tests: each rank runs in its node's
network namespace (``ip netns exec``), reaches its node's daemon over ``TIERCKPT_SOCKET``, and
talks to the other ranks over gloo on the lab's subnet (``GLOO_SOCKET_IFNAME=eth0``; the
rendezvous is a file, ``NET_STORE``).

Rank 0 reads commands on stdin and every rank follows (broadcast): ``save <step>`` saves the
step through DCP and the tiered writer and prints ``saved <step> <seconds>`` or ``failed <step>
<seconds> <error>``; ``load`` restores "latest" on every rank and prints ``loaded <step> ok`` if
every rank got back exactly what it saved then (``loaded <step> MISMATCH <ranks>`` if not);
``quit`` ends the run. Each line is printed once the command is done on every rank.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

NS = sys.argv[1] if len(sys.argv) > 1 else "loop"
NUMEL = 50_000


def state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return {f"rank{rank}": torch.randn(NUMEL, generator=g), f"step{rank}": step}


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.environ['NET_STORE']}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    try:
        while True:
            cmd = [sys.stdin.readline().strip() if rank == 0 else ""]
            dist.broadcast_object_list(cmd, src=0)
            verb, _, arg = cmd[0].partition(" ")
            if verb == "save":
                step = int(arg)
                start = time.monotonic()
                try:
                    dcp.save(state(step, rank), storage_writer=TieredStorageWriter(NS, step))
                    line = f"saved {step} {time.monotonic() - start:.2f}"
                except (Exception, CheckpointException) as e:  # DCP raises a BaseException
                    lines = [x for x in str(e).splitlines() if "Error:" in x] or [type(e).__name__]
                    first = lines[-1].strip()
                    line = f"failed {step} {time.monotonic() - start:.2f} {first}"
            elif verb == "load":
                dest = {f"rank{rank}": torch.zeros(NUMEL), f"step{rank}": -1}
                reader = TieredStorageReader(NS)
                dcp.load(dest, storage_reader=reader)
                step = int(dest[f"step{rank}"])
                want = state(step, rank)
                exact = torch.equal(dest[f"rank{rank}"], want[f"rank{rank}"])
                bad: list[Any] = [None] * world
                dist.all_gather_object(bad, None if exact else rank)
                wrong = [r for r in bad if r is not None]
                line = f"loaded {step} ok" if not wrong else f"loaded {step} MISMATCH {wrong}"
            else:
                return
            dist.barrier()
            if rank == 0:
                print(line, flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
