"""DefaultSavePlanner's options on 2 gloo ranks with replicated state: replicated items are
written once (by rank 0 with ``dedup_save_to_lowest_rank=True``, spread over the ranks without),
``flatten_state_dict=False`` stores nested containers as one bytes item each,
``flatten_sharded_tensors=False`` keeps ShardedTensors as they are; every load gets every value
back bit-exact, on every rank, including the values another rank wrote."""

from __future__ import annotations

import io
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import run_ranks, started

pytestmark = pytest.mark.slow

WORLD = 2
REPLICATED = [f"rep{i}" for i in range(6)]

# name: (save planner options, load planner options)
VARIANTS: dict[str, tuple[dict[str, bool], dict[str, bool]]] = {
    "lowest": ({"dedup_save_to_lowest_rank": True}, {}),
    "balanced": ({"dedup_save_to_lowest_rank": False}, {}),
    # Without flattening, a load puts bytes items into the planner's state dict, which is the
    # caller's only when flatten_sharded_tensors is off too (so for torch's FileSystemReader).
    "noflat": (
        {"flatten_state_dict": False},
        {"flatten_state_dict": False, "flatten_sharded_tensors": False},
    ),
    "noflat-st": ({"flatten_sharded_tensors": False}, {"flatten_sharded_tensors": False}),
}


def _full(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The same tensor on every rank, different for every name."""
    seed = sum(name.encode()) * 131 + len(name)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _sharded(full: torch.Tensor) -> sharded_tensor.ShardedTensor:
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(WORLD)])
    st = sharded_tensor.empty(spec, *full.shape)
    for shard in st.local_shards():
        off = shard.metadata.shard_offsets[0]
        shard.tensor.copy_(full[off : off + shard.tensor.shape[0]])
    return st


def _state(rank: int, mesh: Any, fill: float | None = None) -> dict[str, Any]:
    """What each rank saves; with ``fill``, a destination of the same structure holding ``fill``."""

    def t(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.full(shape, fill) if fill is not None else _full(name, shape)

    blank = fill is not None
    return {
        **{k: t(k, (16, 8)) for k in REPLICATED},
        f"local{rank}": t(f"local{rank}", (5, 3)),
        "dt": distribute_tensor(t("dt", (10, 4)), mesh, [Shard(0)]),
        "st": _sharded(t("st", (7, 3))),
        "opt": None if blank else {"lr": 0.1, "betas": [0.9, 0.99], "m": _full("m", (3,))},
        "blob": None if blank else io.BytesIO(b"replicated payload"),
    }


def _check(dest: dict[str, Any], rank: int, variant: str) -> None:
    for k in REPLICATED:
        assert torch.equal(dest[k], _full(k, (16, 8))), (variant, rank, k)
    for r in range(WORLD):
        assert torch.equal(dest[f"local{r}"], _full(f"local{r}", (5, 3))), (variant, rank, r)
    assert isinstance(dest["dt"], DTensor)
    assert torch.equal(dest["dt"].full_tensor(), _full("dt", (10, 4))), (variant, rank)
    want_st = _sharded(_full("st", (7, 3))).local_shards()
    got_st = dest["st"].local_shards()
    assert len(got_st) == len(want_st) == 1
    assert torch.equal(got_st[0].tensor, want_st[0].tensor), (variant, rank)
    assert dest["opt"]["lr"] == 0.1 and dest["opt"]["betas"] == [0.9, 0.99], (variant, rank)
    assert torch.equal(dest["opt"]["m"], _full("m", (3,))), (variant, rank)
    assert dest["blob"].getvalue() == b"replicated payload", (variant, rank)


def _worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    mesh = init_device_mesh("cpu", (world,))
    for step, (variant, (save_opts, load_opts)) in enumerate(VARIANTS.items(), start=1):
        dcp.save(
            _state(rank, mesh),
            storage_writer=TieredStorageWriter(variant, step),
            planner=DefaultSavePlanner(**save_opts),
        )
        dest = _state(rank, mesh, fill=-3.0)
        for r in range(world):  # every rank also loads what only the other rank saved
            dest[f"local{r}"] = torch.full((5, 3), -3.0)
        dest["opt"] = {"lr": None, "betas": None, "m": torch.zeros(3)}
        dcp.load(
            dest,
            storage_reader=TieredStorageReader(variant, step),
            planner=DefaultLoadPlanner(**load_opts),
        )
        _check(dest, rank, variant)
    dist.barrier()


@pytest.fixture(scope="module")
def saved() -> Iterator[DaemonClient]:
    """Every variant saved and loaded back on 2 ranks (the ranks assert the loads)."""
    with started() as d:
        run_ranks(_worker, WORLD, str(d.socket))
        yield DaemonClient.from_socket(d.socket)


def _where(client: DaemonClient, variant: str) -> dict[str, list[str]]:
    """For each stored fqn, the files that hold a copy of it (once per chunk)."""
    step = list(VARIANTS).index(variant) + 1
    out: dict[str, list[str]] = {}
    for e in client.metadata(variant, step)["storage_data"]:
        out.setdefault(e["fqn"], []).append(e["file"])
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_value_comes_back_and_replicated_ones_are_stored_once(
    saved: DaemonClient, variant: str
) -> None:
    where = _where(saved, variant)
    for k in REPLICATED:
        assert len(where[k]) == 1, (k, where[k])  # one copy, not one per rank
    assert len(where["dt"]) == WORLD and len(where["st"]) == WORLD  # one chunk per rank
    writers = Counter(where[k][0][:6] for k in REPLICATED)  # the rank prefix "r0000N"
    if variant == "lowest":
        assert writers == {"r00000": len(REPLICATED)}
    elif variant == "balanced":
        assert set(writers) == {"r00000", "r00001"}, writers
    if variant == "noflat":
        assert "opt" in where and not any(k.startswith("opt.") for k in where)
    else:
        assert {"opt.lr", "opt.betas", "opt.m"} <= where.keys()
