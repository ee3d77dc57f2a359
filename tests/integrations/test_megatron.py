"""Megatron-Core's own ``CheckpointableShardedTensor`` (a storage-less wrapper, torch's
checkpointable protocol) through ``async_save`` with ``TieredStorageWriter``: staged by its local
tensor, sized by its bytes, loaded back bit-exact, with the weights changed right after
``async_save`` returned never reaching the step. (There is no Megatron integration module yet:
docs/guides/megatron.md.)

Needs megatron-core (Python 3.12; docs/guides/megatron.md has the venv); skipped without it."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

pytest.importorskip("megatron.core", reason="megatron-core is not installed (Python 3.12 venv)")

from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.strategies.checkpointable import (
    CheckpointableShardedTensor,
)

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_client.dcp._staging import staging_size

from helpers import DaemonProcess


def test_megatrons_sharded_tensors_async_save_bit_exact(client_env: DaemonProcess) -> None:
    full = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sh = ShardedTensor.from_rank_offsets("w", full.clone(), replica_id=0)
    sd = {"w": CheckpointableShardedTensor.from_sh_ten(sh), "iteration": 5}
    assert staging_size(sd) == 128  # 8 x 6 bfloat16 = 96 bytes, aligned to 64
    fut = dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter("mcore", 1),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        no_dist=True,
    )
    sh.data.add_(1)  # training goes on: never in the step
    fut.result()
    out = {"w": torch.zeros(8, 6, dtype=torch.bfloat16), "iteration": 0}
    dcp.load(out, storage_reader=TieredStorageReader("mcore", 1), no_dist=True)
    assert torch.equal(out["w"].view(torch.int16), full.view(torch.int16))
    assert out["iteration"] == 5
