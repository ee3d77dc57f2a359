"""Faults injected into each storage method on one rank, the way torch's own tests wrap a writer
or reader to raise: the save or load fails on every rank with an error that names the fault,
nothing is committed, no memory of the failed save stays held (leases, sealed files, pins), and
the next save and load work."""

from __future__ import annotations

import gc
import os
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter
from tierckpt_core.errors import NotFoundError

from helpers import DaemonProcess, run_ranks

pytestmark = pytest.mark.slow

WORLD = 2
NS = "faults"


class InjectedFault(RuntimeError):
    pass


EVERY_RANK = -1


def _maybe_fail(obj: Any, method: str) -> None:
    if method == obj.fail_in and obj.fail_rank in (dist.get_rank(), EVERY_RANK):
        raise InjectedFault(f"injected fault in {method} on rank {obj.fail_rank}")


class FaultyWriter(TieredStorageWriter):
    """Our writer, raising in ``fail_in`` on ``fail_rank`` after the method did its work (the
    worst case for leaks: a lease taken, files sealed, a commit sent)."""

    def __init__(self, *args: Any, fail_in: str, fail_rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_in, self.fail_rank = fail_in, fail_rank

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        out = super().stage(state_dict)
        _maybe_fail(self, "stage")
        return out

    def set_up_storage_writer(self, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(*args, **kwargs)
        _maybe_fail(self, "set_up_storage_writer")

    def prepare_local_plan(self, plan: Any) -> Any:
        out = super().prepare_local_plan(plan)
        _maybe_fail(self, "prepare_local_plan")
        return out

    def prepare_global_plan(self, plans: Any) -> Any:
        out = super().prepare_global_plan(plans)
        _maybe_fail(self, "prepare_global_plan")
        return out

    def write_data(self, plan: Any, planner: Any) -> Any:
        out = super().write_data(plan, planner)
        _maybe_fail(self, "write_data")
        return out

    def finish(self, metadata: Any, results: Any) -> None:
        _maybe_fail(self, "finish")  # before the commit: after it, the step *is* saved
        super().finish(metadata, results)


class FaultyReader(TieredStorageReader):
    """Our reader, raising in ``fail_in`` on ``fail_rank`` after the method did its work."""

    def __init__(self, *args: Any, fail_in: str, fail_rank: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fail_in, self.fail_rank = fail_in, fail_rank

    def read_metadata(self) -> Any:
        out = super().read_metadata()
        _maybe_fail(self, "read_metadata")
        return out

    def set_up_storage_reader(self, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(*args, **kwargs)
        _maybe_fail(self, "set_up_storage_reader")

    def prepare_local_plan(self, plan: Any) -> Any:
        out = super().prepare_local_plan(plan)
        _maybe_fail(self, "prepare_local_plan")
        return out

    def prepare_global_plan(self, plans: Any) -> Any:
        out = super().prepare_global_plan(plans)
        _maybe_fail(self, "prepare_global_plan")
        return out

    def read_data(self, plan: Any, planner: Any) -> Any:
        out = super().read_data(plan, planner)
        _maybe_fail(self, "read_data")
        return out


# The methods DCP calls on every rank, and (coordinator: rank 0) on one.
WRITER_FAULTS = [
    ("set_up_storage_writer", 1),
    ("prepare_local_plan", 1),
    ("prepare_global_plan", 0),
    ("write_data", 1),
    ("finish", 0),
]
# A stage() that fails on one rank only leaves the others waiting in the save's first collective
# (DCP's contract, not ours): it fails on every rank here.
ASYNC_WRITER_FAULTS = [("stage", EVERY_RANK), ("prepare_local_plan", 1), ("write_data", 1)]
READER_FAULTS = [
    ("read_metadata", 1),
    ("set_up_storage_reader", 1),
    ("prepare_local_plan", 1),
    ("prepare_global_plan", 0),
    ("read_data", 1),
]


def _state(step: int, rank: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step * 10 + rank)
    return {
        f"w{rank}": torch.randn(64, 32, generator=g),
        "meta": {"step": step, f"note{rank}": f"rank {rank}"},  # bytes items
    }


def _blank(rank: int) -> dict[str, Any]:
    return {f"w{rank}": torch.zeros(64, 32), "meta": {"step": -1, f"note{rank}": ""}}


def _held(client: DaemonClient) -> tuple[int, int]:
    """What the daemon holds beyond its free pool: (bytes in use, bytes leased)."""
    s = client.status()
    return s.used_bytes - s.pool_bytes, s.leased_bytes


def _committed(client: DaemonClient) -> list[int]:
    try:
        return sorted(c.step for c in client.candidates(NS))
    except NotFoundError:
        return []


def _expect_fault(exc: BaseException, method: str, fail_rank: int) -> None:
    """The error DCP raises on every rank names the injected fault (and its rank)."""
    assert isinstance(exc, CheckpointException), repr(exc)
    assert f"injected fault in {method} on rank {fail_rank}" in str(exc), str(exc)


def _check_nothing_held(client: DaemonClient, baseline: tuple[int, int], what: str) -> None:
    assert _held(client) == baseline, f"{what}: the failed save still holds memory"


def _load_and_check(step: int, rank: int, group: dist.ProcessGroup) -> None:
    dest = _blank(rank)
    dcp.load(dest, storage_reader=TieredStorageReader(NS, step), process_group=group)
    want = _state(step, rank)
    assert torch.equal(dest[f"w{rank}"], want[f"w{rank}"])
    assert dest["meta"] == want["meta"]


def _writer_faults_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    client = DaemonClient.from_socket(socket)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    dcp.save(_state(1, rank), storage_writer=TieredStorageWriter(NS, 1), process_group=group)
    step = 1
    cases = [("sync", m, r) for m, r in WRITER_FAULTS]
    cases += [("async", m, r) for m, r in ASYNC_WRITER_FAULTS]
    for mode, method, fail_rank in cases:
        what = f"{mode} save, fault in {method} on rank {fail_rank}"
        dist.barrier(group)
        baseline = _held(client)
        dist.barrier(group)
        step += 1
        writer = FaultyWriter(NS, step, fail_in=method, fail_rank=fail_rank)
        with pytest.raises(BaseException) as info:
            if mode == "sync":
                dcp.save(_state(step, rank), storage_writer=writer, process_group=group)
            else:
                dcp.async_save(
                    _state(step, rank),
                    storage_writer=writer,
                    process_group=group,
                    async_checkpointer_type=AsyncCheckpointerType.THREAD,
                ).result()
        if method == "stage":  # raised in the trainer by async_save itself
            assert isinstance(info.value, InjectedFault), repr(info.value)
        else:
            _expect_fault(info.value, method, fail_rank)
        # As after a failed step in a training loop: the failed save's objects are dropped.
        del writer, info
        gc.collect()
        dist.barrier(group)
        if rank == 0:
            assert step not in _committed(client), f"{what}: the step was committed"
            _check_nothing_held(client, baseline, what)
        dist.barrier(group)
        # The next save of the same step works, and loads back.
        dcp.save(
            _state(step, rank), storage_writer=TieredStorageWriter(NS, step), process_group=group
        )
        _load_and_check(step, rank, group)
        dist.barrier(group)
        if rank == 0:
            assert step in _committed(client), what


@pytest.mark.daemon_settings(keep_last=20)
def test_a_writer_fault_on_one_rank_commits_nothing_and_holds_nothing(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_writer_faults_worker, WORLD, str(daemon.socket))


def _reader_faults_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    client = DaemonClient.from_socket(socket)
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    for step in (1, 2):
        dcp.save(
            _state(step, rank), storage_writer=TieredStorageWriter(NS, step), process_group=group
        )
    for method, fail_rank in READER_FAULTS:
        dist.barrier(group)
        reader = FaultyReader(NS, 1, fail_in=method, fail_rank=fail_rank, process_group=group)
        with pytest.raises(CheckpointException) as info:
            dcp.load(_blank(rank), storage_reader=reader, process_group=group)
        _expect_fault(info.value, method, fail_rank)
        del reader, info
        _load_and_check(1, rank, group)  # the next load works
    # No pin was left behind: deleting the step frees its memory at once.
    dist.barrier(group)
    if rank == 0:
        gc.collect()
        before = client.status()
        size = next(s.bytes for s in client.steps(NS) if s.step == 1)
        client.delete(NS, 1)
        after = client.status()
        assert _committed(client) == [2]
        assert (before.used_bytes - before.pool_bytes) - (
            after.used_bytes - after.pool_bytes
        ) >= size
    dist.barrier(group)


def test_a_reader_fault_on_one_rank_fails_the_load_and_leaves_no_pin(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_reader_faults_worker, WORLD, str(daemon.socket))
