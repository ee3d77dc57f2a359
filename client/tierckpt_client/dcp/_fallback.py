"""A load of "latest" whose step turns out corrupt while it is read: the ranks agree on it and
read the next older step together (see docs/design.md, "Fallback past a step found corrupt while
it is read").

Reads straight into the tensors (from the persistent tier, from peers, from this node's memory)
verify each block as it lands, so corruption is found during ``read_data``, after DCP planned the
load on the step's metadata. Checking the step before the plan would read it twice; instead each
rank says after its read whether it found the step corrupt (one small all-reduce on a gloo
group; the messages are gathered only when a rank did not read it), and if any did, every rank
reads the older step that rank 0 picks, into the same destinations: a step of the same layout
(the common case: the same model and sharding, saved a few steps earlier) serves the same plan,
and every byte that plan reads is overwritten, so the load is wholly the older step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan

from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_client.dcp.ids import format_checkpoint_id
from tierckpt_core.errors import IntegrityError, StepStateError, TierCkptError, error_from_code

OK, CORRUPT, FAILED = 0, 1, 2


@dataclass(frozen=True)
class Agreement:
    """Who to agree with: ``group`` (None: the default group) unless ``alone``."""

    alone: bool
    group: dist.ProcessGroup | None = None


@dataclass(frozen=True)
class _LoadCall:
    """What the ``dcp.load`` calling the reader was asked: alone, or on which group."""

    no_dist: bool
    group: dist.ProcessGroup | None


def _dcp_load_call() -> _LoadCall | None:
    """How the ``dcp.load`` calling the reader runs: with ``no_dist=True``, and on which group.

    DCP does not tell a storage reader (``read_metadata`` comes before ``set_up_storage_reader``,
    and neither says it), yet a one-rank ``no_dist`` load on a job with a process group must not
    wait in a broadcast that the other ranks never join, and a load on a sub-group must agree on
    the step within that group, not with ranks loading something else. So look at the loader's
    frame; None when there is none (a caller driving the reader itself)."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_load_state_dict" and code.co_filename.endswith("state_dict_loader.py"):
            local = frame.f_locals
            group = getattr(local.get("distW"), "group", local.get("process_group"))
            return _LoadCall(bool(local.get("no_dist", False)), group)
        frame = frame.f_back  # type: ignore[assignment]
    return None


def agreement(process_group: dist.ProcessGroup | None) -> Agreement:
    """Whom a load of "latest" agrees with: the group ``dcp.load`` runs on (``process_group``,
    the reader's, wins: ranks of other groups may be loading other namespaces at the same
    time); no one for a ``no_dist`` load or a process without a process group."""
    call = _dcp_load_call()
    if not (dist.is_available() and dist.is_initialized()) or (call and call.no_dist):
        return Agreement(alone=True)
    group = process_group
    if group is None and call is not None:
        group = call.group
    return Agreement(alone=False, group=group)


def on_cpu(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group`` takes CPU tensors (gloo, alone or beside NCCL): one small tensor
    collective then stands in for an object collective, which pickles and sends a size first
    (two rounds: 2.2 ms for an all-gather of two ranks on the 2-core box against 0.3 for an
    all-reduce of one integer). Every rank of a group answers the same."""
    return "gloo" in str(dist.get_backend(group))


def decide(how: Agreement, find: Callable[[], int], what: str) -> int:
    """``find()`` on rank 0 of the group, its answer (or its error) on every rank: a step as
    one integer broadcast where the group takes CPU tensors, an error (rare) as an object."""
    if how.alone:
        return find()
    group = how.group
    src = dist.get_global_rank(group, 0) if group is not None else 0
    box: list[Any] = [None]
    failed: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            box[0] = ("step", find())
        except Exception as e:  # any error: the other ranks must not wait for the broadcast
            failed = e
            code = e.code if isinstance(e, TierCkptError) else TierCkptError.code
            box[0] = ("error", code, str(e))
    if on_cpu(group):
        step = torch.tensor([box[0][1] if box[0] and box[0][0] == "step" else -1])
        dist.broadcast(step, src=src, group=group)
        if int(step) >= 0:
            return int(step)
        # rank 0 failed: its error follows as an object (every rank got -1 and is here)
    dist.broadcast_object_list(box, src=src, group=group)
    if failed is not None:
        raise failed
    decision = box[0]
    if decision[0] == "error":
        raise error_from_code(decision[1], f"rank 0 could not resolve {what}: {decision[2]}")
    return int(decision[1])


def outcome(error: BaseException | None) -> tuple[int, str]:
    """This rank's read: (OK | CORRUPT | FAILED, what went wrong)."""
    if error is None:
        return OK, ""
    return (CORRUPT if isinstance(error, IntegrityError) else FAILED), str(error)


def agree(mine: tuple[int, str], how: Agreement) -> tuple[int, list[str]]:
    """Every rank's outcome, gathered (object collectives: works on gloo and NCCL groups alike):
    the worst status and the messages of the ranks that found the step corrupt. Where the group
    takes CPU tensors, the worst status first, as one integer: the messages are gathered only
    when a rank did not read the step (seldom)."""
    if how.alone:
        return mine[0], [mine[1]] if mine[0] == CORRUPT else []
    if on_cpu(how.group):
        worst = torch.tensor([mine[0]])
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=how.group)
        if int(worst) == OK:  # (the same on every rank: every rank returns here)
            return OK, []
    size = dist.get_world_size(how.group)
    got: list[Any] = [None] * size
    dist.all_gather_object(got, mine, group=how.group)
    worst_status = max(status for status, _ in got)
    return worst_status, [
        f"rank {r}: {msg}" for r, (status, msg) in enumerate(got) if status == CORRUPT
    ]


def plan_misfit(plan: LoadPlan, old: dict[Any, ShardRef], new: dict[Any, ShardRef]) -> str | None:
    """Why ``plan`` (made on the step with storage ``old``) cannot be read from a step with
    storage ``new``; None when it can: every item is stored there, tensors in the same chunk
    with the same dtype and shape."""
    for item in plan.items:
        was, now = old.get(item.storage_index), new.get(item.storage_index)
        what = item.storage_index.fqn
        if now is None:
            return f"it has no {what} at {list(item.storage_index.offset or ())}"
        if item.type == LoadItemType.BYTE_IO:
            continue
        if was is not None and (now.dtype, now.shape) != (was.dtype, was.shape):
            return f"its {what} is {now.dtype} {now.shape}, not {was.dtype} {was.shape}"
    return None


def misfit_error(namespace: str, bad: int | None, step: int, why: str) -> StepStateError:
    """The load's error when the older step cannot serve its plan; it carries the step as
    ``fallback_step`` (``Checkpointer.restore`` then loads it with a plan of its own)."""
    error = StepStateError(
        f"{namespace}/step {bad} is corrupt, and the next older step (step {step}) cannot be read "
        f"into this load's plan ({why}): load it explicitly (TieredStorageReader({namespace!r}, "
        f"{step}), or checkpoint_id={format_checkpoint_id(namespace, step)!r})"
    )
    error.fallback_step = step  # type: ignore[attr-defined]
    return error
