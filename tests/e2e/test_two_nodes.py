"""Two "nodes" on one machine: a daemon each, one rank each, one shared persistent tier."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess, run_ranks

pytestmark = pytest.mark.slow


def _full() -> torch.Tensor:
    return torch.randn(32, 8, generator=torch.Generator().manual_seed(5))


def _worker(rank: int, world: int, sockets: list[str], url: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = sockets[rank]  # each rank on its own node's daemon
    os.environ["TIERCKPT_PERSIST_URL"] = url
    mesh = init_device_mesh("cpu", (world,))
    group = dist.new_group(backend="gloo")
    sd = {"w": distribute_tensor(_full(), mesh, [Shard(0)]), "extra": {"step": 7}}
    dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter("multi", 7),
        process_group=group,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    ).result()
    dist.barrier()
    dest = {"w": distribute_tensor(torch.zeros(32, 8), mesh, [Shard(1)]), "extra": {"step": -1}}
    reader = TieredStorageReader("multi", process_group=group)
    dcp.load(dest, storage_reader=reader, process_group=group)
    assert reader.resolved_step == 7
    assert torch.equal(dest["w"].full_tensor(), _full())
    assert dest["extra"] == {"step": 7}


def test_a_save_spanning_two_daemons_goes_through_the_persistent_tier(
    tmp_path: Path, make_node: Callable[..., DaemonProcess]
) -> None:
    url = f"file://{tmp_path / 'store'}"
    nodes = [make_node(persist_url=url) for _ in range(2)]
    run_ranks(_worker, 2, [str(n.socket) for n in nodes], url)
    assert (tmp_path / "store" / "multi" / "step_000000000007" / "COMMITTED").exists()
