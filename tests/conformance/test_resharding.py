"""Resharding: DTensor state saved on one layout loads bit-exact on another.

One 4-rank gloo job saves the same full tensors (built deterministically on every rank) under
three layouts: a 1-D mesh of 4, a 2x2 mesh, and a 1-D mesh of 2. The 2-rank saves and loads run as
DCP jobs of their own on the two 2-rank groups of the 2x2 mesh (each group its own process group,
namespace and coordinator, as a replica group of HSDP saves). Then every checkpoint is loaded
into every other layout: 4 -> 2x2, 2x2 -> 4, 2 -> 2x2 and 2 -> 4 on 4 ranks; 4 -> 2 and 2x2 -> 2
on 2 ranks; and everything into plain tensors in one process with no process group at all, from
the daemon's memory and from the persistent tier read without a daemon. Each
rank compares its own shard with the shard of the full tensor that it should hold, so a chunk
lost, swapped between ranks or misplaced inside its tensor fails. Shapes are uneven on purpose (a
rank of the 1-D mesh of 4 holds an empty shard)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess, run_ranks
from kit import wait_durable

WORLD = 4
NAMESPACES = ["1d4", "2d", "1d2-0", "1d2-1"]
SHAPES: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "a": ((12, 6), torch.float32),
    "b": ((10, 3), torch.float64),  # 10 rows over 4 ranks: 3, 3, 3, 1
    "c": ((6, 9), torch.int64),  # 9 columns over 4 ranks: 3, 3, 3, 0 (an empty shard)
}
# Layout name -> placements per tensor; the mesh comes from the layout name.
LAYOUTS: dict[str, dict[str, list[Placement]]] = {
    "1d4": {"a": [Shard(0)], "b": [Shard(0)], "c": [Shard(1)]},
    "2d": {"a": [Shard(0), Shard(1)], "b": [Replicate(), Shard(0)], "c": [Shard(1), Shard(0)]},
    "1d2": {"a": [Shard(0)], "b": [Shard(1)], "c": [Replicate()]},
    "1d2-other": {"a": [Shard(1)], "b": [Shard(0)], "c": [Shard(0)]},
}


def _full(name: str) -> torch.Tensor:
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(1000 + ord(name))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=dtype)
    return torch.randint(-(2**50), 2**50, shape, generator=g, dtype=dtype)


def _state(mesh: DeviceMesh, layout: str, blank: bool = False) -> dict[str, Any]:
    out = {}
    for name, placements in LAYOUTS[layout].items():
        full = torch.full_like(_full(name), -1) if blank else _full(name)
        out[name] = distribute_tensor(full, mesh, placements)
    return {"model": out}


def _check(dest: dict[str, Any], mesh: DeviceMesh, layout: str, what: str) -> None:
    want = _state(mesh, layout)["model"]
    for name, got in dest["model"].items():
        assert isinstance(got, DTensor) and got.placements == want[name].placements, (what, name)
        local, expect = got.to_local(), want[name].to_local()
        assert local.shape == expect.shape, (what, name, local.shape, expect.shape)
        assert torch.equal(local, expect), (what, name, dist.get_rank())


def _load(ns: str, mesh: DeviceMesh, layout: str, group: Any = None) -> None:
    dest = _state(mesh, layout, blank=True)
    dcp.load(dest, storage_reader=TieredStorageReader(ns, 1), process_group=group)
    _check(dest, mesh, layout, f"{ns} -> {layout}")


def _worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    flat = init_device_mesh("cpu", (world,))
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    pair = grid["shard"]  # ranks {0, 1} and {2, 3}: two 2-rank meshes
    pair_group = pair.get_group()
    me = rank // 2  # which pair this rank is in; its 2-rank checkpoint is "1d2-<me>"

    # async_save stages in stage() (rank 3's empty shard of "c" included), save in write_data.
    dcp.async_save(
        _state(flat, "1d4"),
        storage_writer=TieredStorageWriter("1d4", 1),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    ).result()
    dcp.save(_state(grid, "2d"), storage_writer=TieredStorageWriter("2d", 1))
    dcp.async_save(
        _state(pair, "1d2"),
        storage_writer=TieredStorageWriter(f"1d2-{me}", 1),
        process_group=pair_group,
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
    ).result()
    if me == 1:  # pair 1's checkpoint gets a newer step: its "latest" is 7, pair 0's is 1
        dcp.save(
            _state(pair, "1d2"),
            storage_writer=TieredStorageWriter("1d2-1", 7),
            process_group=pair_group,
        )
    dist.barrier()

    # Each pair loads its own "latest" at the same time, the reader given no group: the step is
    # agreed within the group dcp.load runs on (the reader once agreed on the whole world, and
    # pair 1 silently loaded step 1, pair 0's decision).
    latest = TieredStorageReader(f"1d2-{me}")
    dest = _state(pair, "1d2", blank=True)
    dcp.load(dest, storage_reader=latest, process_group=pair_group)
    assert latest.resolved_step == (1, 7)[me], (rank, latest.resolved_step)
    _check(dest, pair, "1d2", f"latest of 1d2-{me}")

    # On 4 ranks: 1-D <-> 2-D, and the 2-rank checkpoints onto both meshes of 4.
    _load("1d4", grid, "2d")
    _load("2d", flat, "1d4")
    _load("1d2-0", grid, "2d")
    _load("1d2-1", flat, "1d4")
    # On 2 ranks (each pair its own job): from 4 and 2x2, and from the other pair's 2 ranks
    # with other placements.
    _load("1d4", pair, "1d2", pair_group)
    _load("2d", pair, "1d2", pair_group)
    _load(f"1d2-{1 - me}", pair, "1d2-other", pair_group)


@pytest.mark.slow
def test_dtensors_reshard_across_world_sizes_and_mesh_dimensions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_node: Callable[..., DaemonProcess]
) -> None:
    store = f"file://{tmp_path / 'store'}"
    daemon = make_node(persist_url=store)
    monkeypatch.setenv("TIERCKPT_SOCKET", str(daemon.socket))
    run_ranks(_worker, WORLD, str(daemon.socket))  # the ranks check their 4- and 2-rank loads
    wait_durable(NAMESPACES)
    # On 1 rank, in a process with no group: every checkpoint, whole, into plain tensors
    # (contiguous, and transposed: each chunk lands in a strided region); from the daemon's
    # memory, and from the persistent tier alone, read by the reader itself (no daemon).
    for source in ("memory", "persistent tier"):
        if source == "persistent tier":
            monkeypatch.setenv("TIERCKPT_SOCKET", str(tmp_path / "no-daemon.sock"))
            monkeypatch.setenv("TIERCKPT_PERSIST_URL", store)
        for ns in NAMESPACES:
            for layout in ("contiguous", "transposed"):
                dest = {"model": {name: _blank(name, layout) for name in SHAPES}}
                dcp.load(dest, storage_reader=TieredStorageReader(ns, 1), no_dist=True)
                for name in SHAPES:
                    assert torch.equal(dest["model"][name], _full(name)), (source, ns, name)


def _blank(name: str, layout: str) -> torch.Tensor:
    full = _full(name)
    if layout == "transposed":
        return torch.full_like(full.t().contiguous(), -1).t()
    return torch.full_like(full, -1)
