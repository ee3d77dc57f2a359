"""A Checkpointer's restore on two ranks (forked + gloo, a real daemon) takes DCP's load steps
without DCP's object collectives (``_local_load``): a restore that works sends no object at all,
and a rank that fails to plan, to read (a load of "latest", or of an explicit step), or resolves
another step fails the restore on every rank with DCP's ``CheckpointException`` naming that
rank's error."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client import Checkpointer, StepStateError, _local_load
from tierckpt_client._load_plan import LoadPlanner
from tierckpt_client.dcp import TieredStorageReader
from tierckpt_client.dcp.reader import TieredStorageReader as Reader
from tierckpt_core.errors import TierCkptError

from helpers import DaemonProcess, run_ranks

WORLD = 2
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "broadcast_object_list",
)


def _state(rank: int, step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {
        "model": {f"r{rank}.w{i}": torch.randn(257 + i, generator=g) for i in range(4)},
        "extra": {"step": step},
    }


def _zeros(sd: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": {k: torch.zeros_like(v) for k, v in sd["model"].items()},
        "extra": {"step": -1},
    }


def _count_object_collectives(calls: list[str]) -> None:
    """Record every object collective this rank makes from now on (in ``calls``)."""
    for name in OBJECT_COLLECTIVES:
        real = getattr(dist, name)

        def counted(*a: Any, _real: Any = real, _name: str = name, **k: Any) -> Any:
            calls.append(_name)
            return _real(*a, **k)

        setattr(dist, name, counted)


def _save_steps(ckpt: Checkpointer, rank: int, steps: tuple[int, ...]) -> None:
    for step in steps:
        ckpt.save(step, _state(rank, step))
        ckpt.wait()


def _restore_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    with Checkpointer("local", async_staging=False, handle_signals=False) as ckpt:
        _save_steps(ckpt, rank, (1, 2))
        calls: list[str] = []
        _count_object_collectives(calls)
        out = _zeros(_state(rank, 2))
        assert ckpt.restore(out) == 2
    want = _state(rank, 2)
    assert out["extra"] == {"step": 2}
    assert all(torch.equal(out["model"][k], v) for k, v in want["model"].items())
    assert calls == [], calls  # no pickled round trip on the way


def test_a_restore_on_two_ranks_is_bit_exact_and_sends_no_object(daemon: DaemonProcess) -> None:
    run_ranks(_restore_worker, WORLD, str(daemon.socket))


def _plan_failure_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    with Checkpointer("plan-fails", async_staging=False, handle_signals=False) as ckpt:
        _save_steps(ckpt, rank, (1,))
        out = _zeros(_state(rank, 1))
        if rank == 1:  # a key the step does not have: rank 1's planner fails, rank 0's does not
            out["model"]["r1.missing"] = torch.zeros(3)
        with pytest.raises(CheckpointException) as err:
            ckpt.restore(out)
    assert set(err.value.failures) == {1}, err.value  # on both ranks: rank 1's own error
    exc, _ = err.value.failures[1]
    assert "r1.missing" in str(exc), exc


def test_a_planning_failure_on_one_rank_fails_the_restore_on_every_rank(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_plan_failure_worker, WORLD, str(daemon.socket))


def _reads_fail() -> None:
    """Every read of this rank's tier files fails from now on (this process only)."""

    def gone(*a: Any, **k: Any) -> None:
        raise OSError("the tier file went away")

    Reader._copy_items = gone  # type: ignore[method-assign]


def _assert_rank_1_read_failed(err: CheckpointException) -> None:
    assert set(err.failures) == {1}, err
    exc, _ = err.failures[1]
    assert isinstance(exc, OSError) and "went away" in str(exc), exc


def _read_failure_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    with Checkpointer("read-fails", async_staging=False, handle_signals=False) as ckpt:
        _save_steps(ckpt, rank, (1,))
        if rank == 1:  # rank 1's read fails (not corruption: no older step to fall back to)
            _reads_fail()
        with pytest.raises(CheckpointException) as err:
            ckpt.restore(_zeros(_state(rank, 1)))
    _assert_rank_1_read_failed(err.value)  # on rank 0 too: it read its share, and still fails


def test_a_read_failure_on_one_rank_fails_the_restore_on_every_rank(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_read_failure_worker, WORLD, str(daemon.socket))


def _explicit_read_failure_worker(rank: int, world: int, socket: str) -> None:
    """An explicit step (the Checkpointer's load of an older step with a plan of its own): the
    reader agrees on nothing itself, so the load's own agreement after the read is the one that
    carries rank 1's failure to rank 0."""
    os.environ["TIERCKPT_SOCKET"] = socket
    with Checkpointer("explicit", async_staging=False, handle_signals=False) as ckpt:
        _save_steps(ckpt, rank, (1,))
    if rank == 1:
        _reads_fail()
    reader = TieredStorageReader("explicit", 1, process_group=dist.group.WORLD)
    with pytest.raises(CheckpointException) as err:
        _local_load.load_state_dict(_zeros(_state(rank, 1)), reader, None, planner=LoadPlanner())
    _assert_rank_1_read_failed(err.value)


def test_a_read_failure_of_an_explicit_step_fails_the_load_on_every_rank(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_explicit_read_failure_worker, WORLD, str(daemon.socket))


def _different_steps_worker(rank: int, world: int, socket: str) -> None:
    os.environ["TIERCKPT_SOCKET"] = socket
    with Checkpointer("steps", async_staging=False, handle_signals=False) as ckpt:
        _save_steps(ckpt, rank, (1, 2))
    out = _zeros(_state(rank, 1))
    reader = TieredStorageReader("steps", 1 + rank, process_group=dist.group.WORLD)
    with pytest.raises(CheckpointException) as err:
        _local_load.load_state_dict(out, reader, None, planner=LoadPlanner())
    assert set(err.value.failures) == {0}, err.value  # the check runs on rank 0, as in DCP
    exc, _ = err.value.failures[0]
    assert isinstance(exc, StepStateError) and "ranks resolved different steps" in str(exc), exc


def test_ranks_that_resolved_different_steps_fail_the_load_on_every_rank(
    daemon: DaemonProcess,
) -> None:
    run_ranks(_different_steps_worker, WORLD, str(daemon.socket))


class _TwoArgs(Exception):
    def __init__(self, what: str, where: int) -> None:
        super().__init__(f"{what} at {where}")


def test_an_exception_that_cannot_travel_is_sent_as_one_that_names_it() -> None:
    """An exception whose pickle cannot make it again (``__init__`` takes other arguments than
    its ``args``) would fail the gather of the failures on every rank with a TypeError: it is
    sent as a TierCkptError naming it; one that travels is sent as it is."""
    try:
        raise _TwoArgs("disk", 3)
    except _TwoArgs as e:
        sent, _ = _local_load._sendable(e)
    assert isinstance(sent, TierCkptError) and str(sent) == "_TwoArgs: disk at 3"
    plain, _ = _local_load._sendable(OSError("gone"))
    assert isinstance(plain, OSError) and str(plain) == "gone"
