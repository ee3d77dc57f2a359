"""``TieredStorageWriter(wait="replicated")``: a save counts as done only once every share of
the step has its replica, so losing a node right after it returned loses nothing (issue 32,
item 6). Two daemons as two nodes, one rank each; the node whose share the step holds is killed
the moment the save returns, and comes back with its memory wiped."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tierckpt_client import ClientConfig, DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess, run_ranks

pytestmark = pytest.mark.slow

ROWS = 1 << 16  # 64 Ki rows x 32 float32: 4 MiB per rank, so a push takes a while


def _full() -> torch.Tensor:
    return torch.randn(2 * ROWS, 32, generator=torch.Generator().manual_seed(11))


def _save_then_kill(rank: int, world: int, sockets: list[str], victim: int) -> None:
    os.environ["TIERCKPT_SOCKET"] = sockets[rank]  # each rank on its own node's daemon
    mesh = init_device_mesh("cpu", (world,))
    sd = {"w": distribute_tensor(_full(), mesh, [Shard(0)]), "extra": {"step": 3}}
    dcp.save(sd, storage_writer=TieredStorageWriter("job", 3, wait="replicated"))
    dist.barrier()  # every rank's save returned
    if rank == 1:
        os.kill(victim, signal.SIGKILL)  # node B dies the moment the save is acknowledged


def _load(rank: int, world: int, sockets: list[str]) -> None:
    os.environ["TIERCKPT_SOCKET"] = sockets[rank]
    mesh = init_device_mesh("cpu", (world,))
    dest = {
        "w": distribute_tensor(torch.zeros(2 * ROWS, 32), mesh, [Shard(1)]),
        "extra": {"step": -1},
    }
    reader = TieredStorageReader("job", process_group=dist.group.WORLD)
    dcp.load(dest, storage_reader=reader)
    assert reader.resolved_step == 3
    assert torch.equal(dest["w"].full_tensor(), _full())  # bit-exact
    assert dest["extra"] == {"step": 3}


def test_a_replicated_save_survives_the_loss_of_a_node_right_after_it_returned(
    make_ring: Callable[..., list[DaemonProcess]],
) -> None:
    a, b = make_ring(2)
    sockets = [str(a.socket), str(b.socket)]
    run_ranks(_save_then_kill, 2, sockets, b.pid)
    b.kill()  # (already dead) reaped
    shutil.rmtree(b.shm_dir)  # the node's memory is gone
    b.start()  # its replacement, empty
    run_ranks(_load, 2, sockets)


def test_waiting_for_replicas_without_replication_fails_and_says_why(
    make_node: Callable[..., DaemonProcess],
) -> None:
    d = make_node()
    config = ClientConfig.from_env(socket=d.socket)
    writer = TieredStorageWriter("solo", 1, wait="replicated", config=config)
    with pytest.raises(CheckpointException, match="needs peers"):
        dcp.save({"w": torch.arange(16.0)}, storage_writer=writer, no_dist=True)
    with DaemonClient.from_socket(d.socket) as c:  # the step itself stays committed
        assert [s.step for s in c.steps("solo")] == [1]
