"""FSDP2 (fully_shard) model + optimizer state through the daemon, loaded into another sharding."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess, run_ranks

pytestmark = pytest.mark.slow


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Odd sizes: FSDP2 shards dim 0 unevenly across 2 ranks.
    return nn.Sequential(nn.Linear(9, 13), nn.ReLU(), nn.Linear(13, 5))


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        loss = model(torch.randn(4, 9, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def _fsdp2_worker(rank: int, world: int, socket: str, ns: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))
    ckpt_group = dist.new_group(backend="gloo")
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, 3)
    msd, osd = get_state_dict(model, opt)
    fut = dcp.async_save(
        {"model": msd, "optim": osd},
        storage_writer=TieredStorageWriter(ns, 3),
        process_group=ckpt_group,
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
    )
    fut.result()
    expected = {k: v.full_tensor() for k, v in model.state_dict().items()}
    probe = torch.randn(2, 9, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected_out = model(probe)

    # Resharding: load the sharded checkpoint into a plain, unsharded replica on every rank.
    plain = _model()
    for p in plain.parameters():
        p.data.zero_()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    _train(plain, plain_opt, 1)  # creates optimizer state to load into
    psd, posd = get_state_dict(plain, plain_opt)
    state = {"model": psd, "optim": posd}
    dcp.load(state, storage_reader=TieredStorageReader(ns), process_group=ckpt_group)
    set_state_dict(
        plain, plain_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    for k, v in plain.state_dict().items():
        assert torch.equal(v, expected[k]), k
    with torch.no_grad():
        assert torch.equal(plain(probe), expected_out)
    # The optimizer state (AdamW moments and step counts) came back too, bit-exact.
    _, sharded_osd = get_state_dict(model, opt)
    _, plain_osd = get_state_dict(plain, plain_opt)
    assert sharded_osd["state"].keys() == plain_osd["state"].keys()
    for fqn, entries in sharded_osd["state"].items():
        for name, value in entries.items():
            full = value.full_tensor() if hasattr(value, "full_tensor") else value
            assert torch.equal(full, plain_osd["state"][fqn][name]), (fqn, name)


def test_fsdp2_state_roundtrip_and_reshard(daemon: DaemonProcess) -> None:
    run_ranks(_fsdp2_worker, 2, str(daemon.socket), "fsdp2")
