"""Save and load against the DCP contract: what torch's own storage writers and readers do, ours
must do too (plan caching, ShardedTensor with async_save, use_collectives, no_dist loads of
"latest", overwrite, checkpoint ids). Every dtype: test_dtypes.py."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import ChunkShardingSpec
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.errors import StepStateError

from helpers import DaemonProcess, run_ranks

WORLD = 2


def _rows(step: int, rank: int) -> torch.Tensor:
    return torch.full((3, 4), float(step * 10 + rank))


# -- plan caching ----------------------------------------------------------------------------
def _plan_caching_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    # Steps 1, 2, 3 and then step 3 again: the plans are the same each time, so DCP hands every
    # rank its cached plan from the first save.
    for n, step in enumerate((1, 2, 3, 3)):
        sd = {f"r{r}": _rows(step + 100 * n, r) for r in range(world)}
        dcp.save(
            sd,
            storage_writer=TieredStorageWriter("cache", step),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
    for step, n in ((1, 0), (2, 1), (3, 3)):
        dest = {f"r{r}": torch.zeros(3, 4) for r in range(world)}
        dcp.load(dest, storage_reader=TieredStorageReader("cache", step))
        for r in range(world):
            assert torch.equal(dest[f"r{r}"], _rows(step + 100 * n, r)), (step, r)


@pytest.mark.slow
@pytest.mark.daemon_settings(keep_last=4)
def test_plan_caching_saves_every_step(daemon: DaemonProcess) -> None:
    run_ranks(_plan_caching_worker, WORLD, str(daemon.socket))
    steps = DaemonClient.from_socket(daemon.socket).candidates("cache")
    assert sorted(c.step for c in steps) == [1, 2, 3]


# -- ShardedTensor with async_save -----------------------------------------------------------
def _sharded(fill: float) -> sharded_tensor.ShardedTensor:
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(WORLD)])
    st = sharded_tensor.zeros(spec, 8, 4)
    for shard in st.local_shards():
        shard.tensor.copy_(
            torch.arange(shard.tensor.numel(), dtype=torch.float32).view_as(shard.tensor) + fill
        )
    return st


def _sharded_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    group = dist.new_group(backend="gloo")
    for step, mode in enumerate(("thread", "process")):
        sd = {"st": _sharded(100.0 * step + rank), "plain": torch.ones(2) * step}
        fut = dcp.async_save(
            sd,
            storage_writer=TieredStorageWriter("sharded", step),
            process_group=group,
            async_checkpointer_type=AsyncCheckpointerType(mode),
        )
        sd["st"].local_shards()[0].tensor.mul_(-1)  # training goes on: the save keeps its copy
        fut.result()
        dest = {"st": _sharded(0.0), "plain": torch.zeros(2)}
        for shard in dest["st"].local_shards():
            shard.tensor.zero_()
        dcp.load(dest, storage_reader=TieredStorageReader("sharded", step), process_group=group)
        want = _sharded(100.0 * step + rank)
        assert torch.equal(dest["st"].local_shards()[0].tensor, want.local_shards()[0].tensor)
        assert torch.equal(dest["plain"], torch.ones(2) * step)


@pytest.mark.slow
def test_async_save_stages_sharded_tensors(daemon: DaemonProcess) -> None:
    run_ranks(_sharded_worker, WORLD, str(daemon.socket))


# -- use_collectives=False and no_dist loads -------------------------------------------------
def _no_collectives_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    sd = {f"r{rank}": _rows(1, rank)}
    with pytest.raises(StepStateError, match=r"use_collectives=False\) is not supported"):
        dcp.save(sd, storage_writer=TieredStorageWriter("nocoll", 1), use_collectives=False)
    dist.barrier()
    # Alone, each rank may: with no_dist=True, or on a group of its own (the writer once counted
    # the whole job and refused these too, advising the no_dist=True that had been passed).
    solo = [dist.new_group([r], backend="gloo") for r in range(world)][rank]
    for how, kw in (("nodist", {"no_dist": True}), ("solo", {"process_group": solo})):
        ns = f"{how}{rank}"
        dcp.save(sd, storage_writer=TieredStorageWriter(ns, 1), use_collectives=False, **kw)
        dest = {f"r{rank}": torch.zeros(3, 4)}
        dcp.load(dest, storage_reader=TieredStorageReader(ns, 1), no_dist=True)
        assert torch.equal(dest[f"r{rank}"], _rows(1, rank)), how

    # One rank alone loads "latest" with no_dist=True: it decides the step itself.
    for step in (5, 6):
        dcp.save({"w": _rows(step, 0)}, storage_writer=TieredStorageWriter("alone", step))
    short = dist.new_group(backend="gloo", timeout=timedelta(seconds=15))
    if rank == 1:
        dest = {"w": torch.zeros(3, 4)}
        reader = TieredStorageReader("alone", process_group=short)
        dcp.load(dest, storage_reader=reader, no_dist=True)
        assert reader.resolved_step == 6
        assert torch.equal(dest["w"], _rows(6, 0))


@pytest.mark.slow
def test_no_collectives_save_is_refused_on_many_ranks_allowed_alone_and_a_no_dist_load_decides_alone(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_no_collectives_worker, WORLD, str(daemon.socket))
    client = DaemonClient.from_socket(daemon.socket)
    assert [c.step for c in client.candidates("alone")] == [6, 5]
    for ns in ("nodist0", "nodist1", "solo0", "solo1"):
        assert [c.step for c in client.candidates(ns)] == [1], ns
    with pytest.raises(Exception, match="nocoll"):  # nothing of the refused save was committed
        client.candidates("nocoll")


# -- overwrite and checkpoint ids (one process) -----------------------------------------------
def test_overwrite_false_keeps_the_committed_step(client_env: DaemonProcess) -> None:
    first, second = {"w": torch.ones(4)}, {"w": torch.full((4,), 2.0)}
    dcp.save(first, storage_writer=TieredStorageWriter("ow", 1, overwrite=False), no_dist=True)
    # DCP wraps the writer's StepStateError; its text carries the writer's message.
    with pytest.raises(
        CheckpointException, match=r"ow/step 1 is already committed.*overwrite=False"
    ):
        dcp.save(second, storage_writer=TieredStorageWriter("ow", 1, overwrite=False), no_dist=True)
    dest = {"w": torch.zeros(4)}
    dcp.load(dest, storage_reader=TieredStorageReader("ow", 1), no_dist=True)
    assert torch.equal(dest["w"], first["w"])
    # The default, as torch's FileSystemWriter: a new save of the step replaces it.
    dcp.save(second, storage_writer=TieredStorageWriter("ow", 1), no_dist=True)
    dcp.load(dest, storage_reader=TieredStorageReader("ow", 1), no_dist=True)
    assert torch.equal(dest["w"], second["w"])


def _refused_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    group = dist.new_group(backend="gloo")
    sd = {f"r{rank}": torch.ones(1 << 18) * rank}
    dcp.save(sd, storage_writer=TieredStorageWriter("refused", 1), process_group=group)
    # The writers stay referenced, as a trainer's do: nothing is given back by the collector.
    writers = [TieredStorageWriter("refused", 1, overwrite=False) for _ in range(2)]
    with pytest.raises(CheckpointException, match="overwrite=False"):
        dcp.async_save(sd, storage_writer=writers[0], process_group=group).result()
    with pytest.raises(CheckpointException, match="overwrite=False"):
        dcp.save(sd, storage_writer=writers[1], process_group=group)
    dist.barrier(group)
    if rank == 0:
        # Right after the refusals, on every rank: nothing leased, no save in progress (the
        # files went back at the refusal, not after TIERCKPT_LEASE_TTL_S).
        status = DaemonClient.from_socket(socket).status()
        assert status.leased_bytes == 0, status
        assert [(n.namespace, n.steps) for n in status.namespaces] == [("refused", 1)]
    dist.barrier(group)
    del writers


@pytest.mark.slow
def test_a_save_refused_by_overwrite_false_gives_its_memory_back_on_every_rank(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_refused_worker, WORLD, str(daemon.socket))


def test_a_checkpoint_id_names_the_step_with_our_writer_and_reader(
    client_env: DaemonProcess,
) -> None:
    """What the README promises for ``checkpoint_id="tierckpt://..."``."""
    sd = {"w": torch.arange(6.0)}
    dcp.save(sd, checkpoint_id="tierckpt://ids/100", storage_writer=TieredStorageWriter())
    dest = {"w": torch.zeros(6)}
    reader = TieredStorageReader()
    dcp.load(dest, checkpoint_id="tierckpt://ids", storage_reader=reader)
    assert reader.resolved_step == 100
    assert torch.equal(dest["w"], sd["w"])
