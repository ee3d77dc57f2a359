"""The Checkpointer's load plan for a resume equals DCP's own, item for item; anything else is
DCP's to plan."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tierckpt_client import _load_plan


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, generator=g),
        "m": torch.randn(3, 5, 2, generator=g).to(torch.bfloat16),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "p": torch.nn.Parameter(torch.randn(9, generator=g)),
        "nested": {"a": torch.randn(11, generator=g), "step": 12, "tag": "x"},
    }


def _saved(tmp_path: Path, state: dict[str, Any]) -> Any:
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)
    return dcp.FileSystemReader(str(tmp_path)).read_metadata()


def _plans(state: dict[str, Any], metadata: Any) -> tuple[Any, Any, Any]:
    ours, theirs = _load_plan.LoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(state, metadata, True)
    theirs.set_up_planner(state, metadata, True)
    whole = _load_plan.whole_plan(ours.state_dict, metadata.state_dict_metadata)
    return whole, ours.create_local_plan(), theirs.create_local_plan()


def _load(state: dict[str, Any], tmp_path: Path) -> None:
    """``dcp.load`` of the step saved in ``tmp_path`` into ``state``, planned by ours."""
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(
            state,
            storage_reader=dcp.FileSystemReader(str(tmp_path)),
            planner=_load_plan.LoadPlanner(),
            no_dist=True,
        )


def _key(item: Any) -> tuple[Any, ...]:
    return (
        item.type,
        item.dest_index.fqn,
        item.dest_index.offset,
        item.dest_index.index,
        item.dest_offsets,
        item.storage_index.fqn,
        item.storage_index.offset,
        item.storage_index.index,
        item.storage_offsets,
        item.lengths,
    )


def test_a_resume_is_planned_here_as_dcp_plans_it(tmp_path: Path) -> None:
    metadata = _saved(tmp_path, _state(1))
    whole, ours, theirs = _plans(_state(2), metadata)
    assert whole is not None  # planned here, not by DCP
    assert [_key(i) for i in ours.items] == [_key(i) for i in theirs.items]
    assert len(ours.items) == 7  # the empty tensor has none, as in DCP's plan

    # And the load through it gives the saved values.
    state = _state(3)
    _load(state, tmp_path)
    want = _state(1)
    for k in ("w", "m", "scalar", "empty", "p"):
        assert torch.equal(state[k], want[k]), k
    assert torch.equal(state["nested"]["a"], want["nested"]["a"])
    assert state["nested"]["step"] == 12 and state["nested"]["tag"] == "x"


def test_a_state_with_fewer_keys_than_the_step_is_planned_as_dcp_plans_it(tmp_path: Path) -> None:
    """A rank that loads some of a step's keys (its own stage's): planned here, the same items
    as DCP's plan, and the load gives the saved values of those keys."""
    metadata = _saved(tmp_path, _state(1))
    state = _state(2)
    del state["w"], state["nested"]
    whole, ours, theirs = _plans(state, metadata)
    assert whole is not None
    assert [_key(i) for i in ours.items] == [_key(i) for i in theirs.items]
    assert {i.dest_index.fqn for i in ours.items} == {"m", "scalar", "p"}
    _load(state, tmp_path)
    want = _state(1)
    assert all(torch.equal(state[k], want[k]) for k in ("m", "scalar", "empty", "p"))


@pytest.mark.parametrize("change", ["a key more", "another shape", "a tensor stored as bytes"])
def test_anything_else_is_left_to_dcp(tmp_path: Path, change: str) -> None:
    metadata = _saved(tmp_path, _state(1))
    state = _state(2)
    if change == "a key more":
        state["extra"] = torch.zeros(2)
    elif change == "another shape":
        state["w"] = torch.zeros(32)
    else:
        state["nested"]["step"] = torch.zeros(1)
    ours, theirs = _load_plan.LoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(state, metadata, True)
    theirs.set_up_planner(state, metadata, True)
    assert _load_plan.whole_plan(ours.state_dict, metadata.state_dict_metadata) is None
    try:
        expected = [_key(i) for i in theirs.create_local_plan().items]
    except Exception as e:  # DCP's own error, raised by ours as well
        with pytest.raises(type(e), match=re.escape(str(e))):
            ours.create_local_plan()
        return
    assert [_key(i) for i in ours.create_local_plan().items] == expected


def test_a_tensor_stored_in_chunks_is_left_to_dcp() -> None:
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    size = torch.Size([8])
    halves = [
        ChunkStorageMetadata(torch.Size([0]), torch.Size([4])),
        ChunkStorageMetadata(torch.Size([4]), torch.Size([4])),
    ]
    md = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, halves)
    assert _load_plan.whole_plan({"w": torch.zeros(8)}, {"w": md}) is None
    one = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, halves[:1])
    assert _load_plan.whole_plan({"w": torch.zeros(8)}, {"w": one}) is None  # not whole


def test_its_items_resolve_to_the_state_dicts_own_tensors(tmp_path: Path) -> None:
    """Each item of the plan made here resolves to the tensor DCP resolves it to (the same
    bytes, shape and dtype: the state dict's own tensor); an item it did not make, even an equal
    one, is DCP's to resolve."""
    import dataclasses

    metadata = _saved(tmp_path, _state(1))
    state = _state(2)
    ours, theirs = _load_plan.LoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(state, metadata, True)
    theirs.set_up_planner(state, metadata, True)
    plan = ours.create_local_plan()
    tensors = [i for i in plan.items if i.type == _load_plan.LoadItemType.TENSOR]
    assert len(tensors) == 5  # w, m, scalar, p, nested.a (the empty tensor has no item)
    for item in tensors:
        got, want = ours.resolve_tensor(item), theirs.resolve_tensor(item)
        assert got.data_ptr() == want.data_ptr()
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
        assert got is ours.state_dict[item.dest_index.fqn]
        copy = dataclasses.replace(item)  # resolved by DCP: the same tensor
        assert ours.resolve_tensor(copy).data_ptr() == want.data_ptr()
