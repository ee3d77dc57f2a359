"""Objects that implement torch's checkpointable protocol (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``) and hold no storage of their own, as
Megatron-Core's ``CheckpointableShardedTensor`` does: ``stage()`` stages their local tensors and
``staging_size`` counts those tensors' bytes, not the global shape's; saves through sync
``dcp.save`` and ``async_save`` (THREAD and PROCESS) on two gloo ranks load back bit-exact, with the
weights changed right after ``async_save`` returned never reaching the step."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._checkpointable import _Checkpointable
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp._staging import align, staging_size

from helpers import DaemonProcess, run_ranks


class RowShards(torch.Tensor):
    """Row blocks ``(first_row, tensor)`` of a larger tensor: a wrapper with the global shape and
    no storage, whose every tensor operation raises (as Megatron's wrapper does)."""

    shards: list[tuple[int, torch.Tensor]]

    @staticmethod
    def __new__(cls, rows: int, shards: list[tuple[int, torch.Tensor]]) -> RowShards:
        cols, dtype = shards[0][1].shape[1], shards[0][1].dtype
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size([rows, cols]), dtype=dtype)
        r.shards = shards
        return r  # type: ignore[no-any-return]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"{cls.__name__} supports no tensor operation ({func})")

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([row, 0]), i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([row, 0]), sizes=t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.shape,
                ),
            )
            for i, (row, t) in enumerate(self.shards)
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size([row, 0]), t.shape) for row, t in self.shards]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for row, t in self.shards:
            if torch.Size([row, 0]) == index.offset:
                return t
        raise ValueError(f"no shard at {index.offset}")

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"RowShards(rows={[row for row, _ in self.shards]})"


def _global(step: int) -> torch.Tensor:
    return torch.randn(64, 300, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)


def _rank_state(step: int, rank: int, world: int) -> dict[str, Any]:
    """This rank's two row blocks of the global tensor (rows interleaved across ranks)."""
    full, n = _global(step), 64 // (2 * world)
    blocks = [(b * n, full[b * n : (b + 1) * n].clone()) for b in (rank, rank + world)]
    return {"model": {"w": RowShards(64, blocks), "bias": full[0].float().clone()}, "step": step}


def test_staging_size_counts_the_local_bytes_only() -> None:
    sd = _rank_state(1, rank=0, world=2)
    w = sd["model"]["w"]
    assert isinstance(w, _Checkpointable)
    local = 2 * 16 * 300 * 2  # two 16 x 300 bfloat16 blocks, not the 64 x 300 global shape
    assert staging_size(sd) == 2 * align(local // 2) + align(300 * 4)


def _worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    kinds: dict[int, AsyncCheckpointerType | None] = {
        1: None,
        2: AsyncCheckpointerType.THREAD,
        3: AsyncCheckpointerType.PROCESS,
    }
    for step, kind in kinds.items():
        sd = _rank_state(step, rank, world)
        writer = TieredStorageWriter("checkpointable", step)
        if kind is None:
            dcp.save(sd, storage_writer=writer)
        else:
            fut = dcp.async_save(sd, storage_writer=writer, async_checkpointer_type=kind)
            for _, t in sd["model"]["w"].shards:  # training goes on: never in the step
                t.add_(1)
            sd["model"]["bias"].add_(1)
            fut.result()
        dist.barrier()
        got = {"model": {"w": torch.zeros(64, 300, dtype=torch.bfloat16), "bias": torch.zeros(300)}}
        got["step"] = 0
        dcp.load(got, storage_reader=TieredStorageReader("checkpointable", step))
        full = _global(step)
        assert torch.equal(got["model"]["w"].view(torch.int16), full.view(torch.int16)), step
        assert torch.equal(got["model"]["bias"], full[0].float()), step
        assert got["step"] == step


@pytest.mark.slow
def test_sync_and_async_saves_of_checkpointable_shards_load_bit_exact(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_worker, 2, str(daemon.socket))


def test_asynchronous_staging_sees_a_change_to_a_wrapped_shard(client_env: DaemonProcess) -> None:
    """With ``async_staging=True`` the trainer's thread notes the version of each tensor the save
    will copy: for a wrapper, its shards' (the wrapper's own never changes). A shard changed in
    place before ``staging_completion`` fails the save instead of committing a torn step."""
    from torch.distributed.checkpoint.api import CheckpointException

    from tierckpt_client.dcp import _async_staging
    from tierckpt_client.dcp._helpers import on_helpers
    from tierckpt_core.errors import StagingRaceError

    sd = _rank_state(1, rank=0, world=1)
    go, started = threading.Event(), threading.Event()
    on_helpers(_async_staging.ASYNC, 1, lambda: (started.set(), go.wait(60)))
    assert started.wait(10)  # the stager's thread is busy: the copy has not started
    try:
        res = dcp.async_save(
            sd,
            storage_writer=TieredStorageWriter("wrapped-race", 1, async_staging=True),
            async_checkpointer_type=AsyncCheckpointerType.THREAD,
            no_dist=True,
        )
        sd["model"]["w"].shards[0][1].add_(1)  # the loop did not wait for staging_completion
    finally:
        go.set()
    with pytest.raises(CheckpointException) as e:
        res.upload_completion.result(timeout=120)
    ((err, _),) = e.value.failures.values()
    assert isinstance(err, StagingRaceError), err
