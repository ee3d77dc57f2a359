"""Whether a load's plan, made on one step, can read an older step instead (``_fallback``)."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from tierckpt_client.dcp._fallback import (
    CORRUPT,
    FAILED,
    OK,
    Agreement,
    agree,
    outcome,
    plan_misfit,
)
from tierckpt_client.dcp._metadata_codec import ShardRef
from tierckpt_core.errors import IntegrityError, StepStateError


def _item(fqn: str, offset: tuple[int, ...], kind: LoadItemType = LoadItemType.TENSOR) -> ReadItem:
    index = MetadataIndex(fqn, torch.Size(offset) if kind == LoadItemType.TENSOR else None)
    return ReadItem(kind, index, torch.Size(offset), index, torch.Size(offset), torch.Size([4]))


def _ref(offset: int, shape: tuple[int, ...] | None = (4, 8), dtype: str = "float32") -> ShardRef:
    return ShardRef("r00000.data", offset, 128, dtype if shape else None, shape)


PLAN = LoadPlan([_item("w", (4, 0)), _item("meta", (), LoadItemType.BYTE_IO)])
OLD = {MetadataIndex("w", torch.Size([4, 0])): _ref(0), MetadataIndex("meta"): _ref(128, None)}


def test_a_step_of_the_same_layout_fits_at_other_offsets() -> None:
    new = {MetadataIndex("w", torch.Size([4, 0])): _ref(512), MetadataIndex("meta"): _ref(0, None)}
    assert plan_misfit(PLAN, OLD, new) is None


def test_another_sharding_dtype_or_a_missing_item_does_not_fit() -> None:
    resharded = {MetadataIndex("w", torch.Size([0, 4])): _ref(0), MetadataIndex("meta"): _ref(0)}
    assert "no w at [4, 0]" in (plan_misfit(PLAN, OLD, resharded) or "")
    other = {
        MetadataIndex("w", torch.Size([4, 0])): _ref(0, (4, 8), "bfloat16"),
        MetadataIndex("meta"): _ref(0, None),
    }
    assert "bfloat16" in (plan_misfit(PLAN, OLD, other) or "")
    assert "no meta" in (
        plan_misfit(PLAN, OLD, {MetadataIndex("w", torch.Size([4, 0])): _ref(0)}) or ""
    )


def test_alone_the_outcome_is_this_process_own() -> None:
    alone = Agreement(alone=True)
    assert agree(outcome(None), alone) == (OK, [])
    assert agree(outcome(IntegrityError("step 6: r0 block 3")), alone) == (
        CORRUPT,
        ["step 6: r0 block 3"],
    )
    assert agree(outcome(StepStateError("other")), alone) == (FAILED, [])
