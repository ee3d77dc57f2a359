"""The DCP contract on two gloo ranks against a real daemon: what ``dcp.save``/``dcp.load`` options
do with tierckpt (use_collectives, no_dist, plan caching, ShardedTensor staging, overwrite)."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.errors import StepStateError

from helpers import DaemonProcess, run_ranks

WORLD = 2


def _rows(rank: int, value: float) -> dict[str, Any]:
    return {f"rank{rank}": torch.full((4,), value), "shared": torch.arange(3.0) + value}


def _collectives_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    with pytest.raises(StepStateError, match=r"use_collectives=False is not supported"):
        dcp.save(
            _rows(rank, 1.0), storage_writer=TieredStorageWriter("solo", 1), use_collectives=False
        )


def test_use_collectives_false_is_refused_and_commits_nothing(daemon: DaemonProcess) -> None:
    run_ranks(_collectives_worker, WORLD, str(daemon.socket))
    with DaemonClient.from_socket(daemon.socket) as client:
        assert client.namespaces() == [] or all(n.namespace != "solo" for n in client.namespaces())


def _no_dist_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    sd = {f"rank{r}": torch.full((4,), float(r + 1)) for r in range(world)}
    dcp.save(sd, storage_writer=TieredStorageWriter("nodist", 5))
    if rank == 1:  # rank 1 loads the newest step alone; rank 0 joins no collective meanwhile
        out = {"rank0": torch.zeros(4)}
        done = threading.Event()

        def load() -> None:
            dcp.load(out, storage_reader=TieredStorageReader("nodist"), no_dist=True)
            done.set()

        threading.Thread(target=load, daemon=True).start()
        assert done.wait(30), "a one-rank no_dist load of the newest step blocked"
        assert torch.equal(out["rank0"], torch.full((4,), 1.0))
    dist.barrier()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_one_rank_no_dist_load_of_latest_decides_alone(daemon: DaemonProcess) -> None:
    run_ranks(_no_dist_worker, WORLD, str(daemon.socket))
