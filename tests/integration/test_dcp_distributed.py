"""Two ranks (spawn + gloo) saving through a real daemon with async_save THREAD and PROCESS."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess, run_ranks

pytestmark = pytest.mark.slow

WORLD = 2


def _full(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 12, generator=g)


def _state(step: int, mesh: object, placements: list[object]) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 + step)
    return {
        "model": {
            "w": distribute_tensor(_full(step), mesh, placements),
            "bias": torch.randn(7, generator=g).to(torch.bfloat16),
            "counts": torch.arange(5, dtype=torch.int64) * step,
        },
        "extra": {"epoch": step // 10, "sampler": {"seen": list(range(step % 7))}},
    }


def _save_worker(rank: int, world: int, socket: str, ns: str, mode: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))
    ckpt_group = dist.new_group(backend="gloo")
    checkpointer = AsyncCheckpointerType(mode)
    for step in (10, 20):
        sd = _state(step, mesh, [Shard(0)])
        fut = dcp.async_save(
            sd,
            storage_writer=TieredStorageWriter(ns, step),
            process_group=ckpt_group,
            async_checkpointer_type=checkpointer,
        )
        # Staging is done when async_save returns: training may now change the live tensors.
        sd["model"]["w"].to_local().mul_(-1)
        sd["model"]["counts"].add_(1000)
        sd["extra"]["epoch"] = -1
        fut.result()

    # Load the newest step into a different sharding (Shard(1) instead of Shard(0)).
    dest = {
        "model": {
            "w": distribute_tensor(torch.zeros(16, 12), mesh, [Shard(1)]),
            "bias": torch.zeros(7, dtype=torch.bfloat16),
            "counts": torch.zeros(5, dtype=torch.int64),
        },
        "extra": {"epoch": 0, "sampler": {"seen": []}},
    }
    reader = TieredStorageReader(ns, process_group=ckpt_group)
    dcp.load(dest, storage_reader=reader, process_group=ckpt_group)
    expected = _state(20, mesh, [Replicate()])
    assert reader.resolved_step == 20
    assert torch.equal(dest["model"]["w"].full_tensor(), _full(20))
    assert torch.equal(dest["model"]["bias"], expected["model"]["bias"])
    assert torch.equal(dest["model"]["counts"], expected["model"]["counts"])
    assert dest["extra"] == expected["extra"]

    # An explicit older step loads too, replicated this time.
    dest10 = {"model": {"w": distribute_tensor(torch.zeros(16, 12), mesh, [Replicate()])}}
    dcp.load(dest10, storage_reader=TieredStorageReader(ns, 10), process_group=ckpt_group)
    assert torch.equal(dest10["model"]["w"].to_local(), _full(10))


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_async_save_roundtrip_two_ranks(daemon: DaemonProcess, mode: str) -> None:
    ns = f"job-{mode}"
    run_ranks(_save_worker, WORLD, str(daemon.socket), ns, mode)

    with DaemonClient.from_socket(daemon.socket) as client:
        steps = client.steps(ns)
        md = client.metadata(ns, 20)
    assert [(s.step, s.state.value) for s in steps] == [(10, "committed"), (20, "committed")]
    assert {"r00000.data", "r00001.data"} <= {f.name for f in steps[-1].files}
    # Zero-copy: every tensor was staged into the leased .data files by stage(), none was copied
    # again by write_data (which would place it in a .extra file) -- in PROCESS mode too.
    tensor_files = {e["file"] for e in md["storage_data"] if e["dtype"] is not None}
    assert tensor_files == {"r00000.data", "r00001.data"}
