"""A :class:`~tierckpt_client.Checkpointer`'s load: DCP's load steps, agreed over integers.

``dcp.load`` (its ``_load_state_dict``) plans on every rank, gathers every rank's plan on rank 0
and scatters them back (``gather_object`` then ``scatter_object``: each pickled, a size sent
first), reads, and gathers every rank's result on every rank (``all_gather_object``). For a load
the global plan is each rank's own plan: DCP's default ``create_global_plan`` returns the plans
as they are, the Checkpointer's planner ships them without their items (``_load_plan``), and the
reader's ``prepare_global_plan`` only checks that every rank resolved the same step. The three
object collectives carry nothing else than whether a rank failed, and why: two ranks on gloo,
16 tensors of 1 MiB, they took ~10-14 ms of a 25-34 ms ``Checkpointer.restore`` on the 2-core box.

:func:`load_state_dict` takes the same steps in DCP's order on each rank (metadata, the planner
and reader set up, the local plan, the global plan of that one plan, the finished plan, the read)
and after the planning and after the read agrees with the group in one all-reduce of a few
integers: whether any rank failed, and (after planning) the step each rank resolved. (After the
read, not where the reader's own agreement on a load of "latest", in ``read_data``, found that
every rank of the same group read the step.) A failure
reaches every rank as DCP's would: a ``CheckpointException`` for the step ("plan" or "read")
holding each failed rank's exception, gathered (an object collective) only then. Ranks that
resolved different steps fail the plan with the reader's own error, as DCP's coordinator does.

The errors in the ``CheckpointException`` are the reader's and the planner's own: DCP's
``_load_state_dict`` (torch 2.13) turns a failing ``read_metadata`` into an ``AssertionError``
("metadata is None; global metadata read failed: ...") while trying rank-local metadata; here the
reader's error (a ``StepNotFoundError``, an ``IntegrityError``) is what the rank failed with.

Where the group does not take CPU tensors (NCCL alone), or the load is not distributed,
:func:`loader` answers None and DCP's ``_load_state_dict`` runs instead.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader

from tierckpt_client.dcp._fallback import on_cpu
from tierckpt_core.errors import TierCkptError

NO_STEP = -1
"""A plan's step in the agreement when its ``storage_data`` is not the reader's (step, latest)."""


def loader(process_group: dist.ProcessGroup | None, no_dist: bool) -> Callable[..., None] | None:
    """:func:`load_state_dict` where a load on ``process_group`` can take it (distributed, on a
    group that takes CPU tensors); None where DCP's own load runs (``_stateful.load``'s
    default)."""
    if no_dist or not dist.is_available() or not dist.is_initialized():
        return None
    return load_state_dict if on_cpu(process_group) else None


def load_state_dict(
    state_dict: dict[str, Any],
    storage_reader: StorageReader,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool = False,
    planner: LoadPlanner | None = None,
) -> None:
    """Load into ``state_dict`` (top-level ``Stateful`` values already their state dicts), as
    DCP's ``_load_state_dict`` with the same arguments does, on ``process_group`` (one that
    :func:`loader` chose this for; ``no_dist``: DCP's parameter, False there); see the
    module."""
    planner = planner or DefaultLoadPlanner()
    group = process_group
    coordinator = dist.get_rank(group) == 0

    plan: LoadPlan | None = None
    failed: BaseException | None = None
    try:
        metadata = storage_reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, coordinator)
        storage_reader.set_up_storage_reader(metadata, coordinator)
        local = storage_reader.prepare_local_plan(planner.create_local_plan())
        # (DCP runs these two on rank 0 over every rank's plan; for the Checkpointer's planner
        # and reader the global plan is each rank's own: a custom planner would need DCP's way)
        (central,) = storage_reader.prepare_global_plan(planner.create_global_plan([local]))
        plan = planner.finish_plan(central)  # here: a rank failing it fails the plan agreement
    except BaseException as e:  # every rank must reach the agreement, whatever it met
        failed = e
    step = _step_of(local if failed is None else None)
    highest, lowest = _agree("plan", failed, group, [step, -step])
    if highest != -lowest:  # ranks resolved different steps: the reader says which
        _different_steps(storage_reader, local, group)
    assert plan is not None

    failed = None
    try:
        storage_reader.read_data(plan, planner).wait()
    except BaseException as e:
        failed = e
    agreed = getattr(storage_reader, "read_agreed", None)
    if agreed is not None and not agreed.alone and agreed.group is group:
        # The reader agreed with this group that every rank read the step (a load of
        # "latest"): every rank is here, none asks again (~0.8 ms of two ranks on the box).
        if failed is not None:  # (after that agreement: nothing raises there)
            raise failed
        return
    _agree("read", failed, group, [])


def _step_of(plan: LoadPlan | None) -> int:
    """The (step, latest) a plan was made for, as one integer for the agreement."""
    data = getattr(plan, "storage_data", None)
    if (
        isinstance(data, tuple)
        and len(data) == 2
        and isinstance(data[0], int)
        and isinstance(data[1], bool)
    ):
        return data[0] * 2 + int(data[1])
    return NO_STEP


def _agree(
    what: str, failed: BaseException | None, group: dist.ProcessGroup | None, values: list[int]
) -> list[int]:
    """One all-reduce (max) of whether this rank failed and ``values``; if any rank failed, every
    rank raises ``CheckpointException(what, {rank: its exception})``, as DCP does. Returns the
    maxima of ``values``."""
    flags = torch.tensor([int(failed is not None), *values], dtype=torch.int64)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if int(flags[0]):
        got: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(got, _sendable(failed) if failed is not None else None, group=group)
        raise CheckpointException(what, {r: w for r, w in enumerate(got) if w is not None})
    return [int(v) for v in flags[1:]]


def _different_steps(
    reader: StorageReader, local: LoadPlan, group: dist.ProcessGroup | None
) -> None:
    """Every rank's step gathered and handed to the reader's check of the global plan, whose
    error (on rank 0, as in DCP) fails the plan on every rank."""
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, local.storage_data, group=group)
    failed: BaseException | None = None
    if dist.get_rank(group) == 0:
        try:
            reader.prepare_global_plan([LoadPlan([], storage_data=data) for data in got])
            failed = TierCkptError(f"the ranks resolved different steps: {got}")
        except BaseException as e:
            failed = e
    _agree("plan", failed, group, [])
    raise AssertionError("rank 0 failed the plan: unreachable")  # pragma: no cover


def _sendable(e: BaseException) -> Any:
    """DCP's wrapped exception, or (when ``e`` cannot travel: not picklable, or not made again
    from its pickle, such as an exception whose ``__init__`` takes other arguments than its
    ``args``) a ``TierCkptError`` naming it, so that every rank still raises the
    ``CheckpointException``. (The bytes unpickled are the ones made here, this moment.)"""
    wrapped = _wrap_exception(e)
    try:
        pickle.loads(pickle.dumps(wrapped))
    except Exception:
        return _wrap_exception(TierCkptError(f"{type(e).__name__}: {e}"))
    return wrapped
