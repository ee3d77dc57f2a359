"""The Checkpointer's load plan for a resume equals DCP's own, item for item; anything else is
DCP's to plan."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from tierckpt_client import _load_plan

from helpers import run_ranks
from kit import DTENSOR_KEYS, dtensor_meshes, dtensor_state


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
    return whole, _final(ours), theirs.create_local_plan()


def _final(planner: Any) -> Any:
    """The plan a rank reads with: its local plan, shipped through DCP's coordinator (pickled
    there and back, as in a load of a process group) and finished by the planner."""
    shipped = pickle.loads(pickle.dumps(planner.create_local_plan()))
    return planner.finish_plan(shipped)


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
    # What DCP ships through its coordinator has none of the items: they stay on the rank.
    planner = _load_plan.LoadPlanner()
    planner.set_up_planner(_state(2), metadata, True)
    assert planner.create_local_plan().items == []
    assert len(ours.items) == 7  # the empty tensor has none, as in DCP's plan
    # Each tensor item holds the step's own key of its chunk (the reader finds it by identity).
    keys = {k: k for k in metadata.storage_data}
    assert all(
        keys[i.storage_index] is i.storage_index for i in ours.items if i.type.name == "TENSOR"
    )

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
    assert [_key(i) for i in _final(ours).items] == expected


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
    bytes, shape and dtype: the state dict's own tensor), also as the copy DCP hands back after
    shipping the plans through its coordinator; an item it did not plan is DCP's to resolve."""
    import dataclasses

    metadata = _saved(tmp_path, _state(1))
    state = _state(2)
    ours, theirs = _load_plan.LoadPlanner(), DefaultLoadPlanner()
    ours.set_up_planner(state, metadata, True)
    theirs.set_up_planner(state, metadata, True)
    plan = _final(ours)
    tensors = [i for i in plan.items if i.type == _load_plan.LoadItemType.TENSOR]
    assert len(tensors) == 5  # w, m, scalar, p, nested.a (the empty tensor has no item)
    for item in tensors:
        got, want = ours.resolve_tensor(item), theirs.resolve_tensor(item)
        assert got.data_ptr() == want.data_ptr()
        assert (got.shape, got.dtype, got.stride()) == (want.shape, want.dtype, want.stride())
        assert got is ours.state_dict[item.dest_index.fqn]
        shipped = pickle.loads(pickle.dumps(item))  # as a load of several ranks gets it back
        assert ours.resolve_tensor(shipped) is ours.state_dict[item.dest_index.fqn]
        if not item.lengths:
            continue  # (a 0-d tensor has no smaller item)
        other = dataclasses.replace(item, lengths=torch.Size([1] * len(item.lengths)))
        got = ours.resolve_tensor(other)  # not an item of this plan: DCP's narrowed view
        assert got is not ours.state_dict[item.dest_index.fqn]
        assert got.shape == other.lengths and got.data_ptr() == want.data_ptr()


# -- DTensors (FSDP2, HSDP) resumed on their mesh ------------------------------------------------


def _dtensor_ranks(rank: int, world: int, path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    meshes = dtensor_meshes(world)
    for name, mesh, placements in meshes:
        where = f"{path}/{name}"
        dcp.save(dtensor_state(mesh, placements, 1), storage_writer=dcp.FileSystemWriter(where))
        metadata = dcp.FileSystemReader(where).read_metadata()
        state = dtensor_state(mesh, placements, 2)
        ours, theirs = _load_plan.LoadPlanner(), DefaultLoadPlanner()
        ours.set_up_planner(state, metadata, rank == 0)
        theirs.set_up_planner(state, metadata, rank == 0)
        assert _load_plan.whole_plan(ours.state_dict, metadata.state_dict_metadata) is not None
        mine = _final(ours).items
        dcps = [
            i
            for i in theirs.create_local_plan().items
            if i.type != _load_plan.LoadItemType.TENSOR or i.lengths.numel()
        ]
        assert [_key(i) for i in mine] == [_key(i) for i in dcps], (name, rank)
        for item in mine:
            if item.type == _load_plan.LoadItemType.TENSOR:
                got, want = ours.resolve_tensor(item), theirs.resolve_tensor(item)
                assert got.data_ptr() == want.data_ptr() and got.shape == want.shape
                shipped = pickle.loads(pickle.dumps(item))  # DCP's plans go through rank 0
                obj = ours.state_dict[item.dest_index.fqn]
                local = obj if item.dest_index.fqn == "plain" else obj._local_tensor
                assert ours.resolve_tensor(shipped) is local
        dcp.load(
            state, storage_reader=dcp.FileSystemReader(where), planner=_load_plan.LoadPlanner()
        )
        want = dtensor_state(mesh, placements, 1)
        for k in DTENSOR_KEYS:
            assert torch.equal(state[k].to_local(), want[k].to_local()), (name, k)
            assert torch.equal(state[k].full_tensor(), want[k].full_tensor()), (name, k)
        m = state["nested"]["m"]
        assert torch.equal(m.full_tensor(), want["nested"]["m"].full_tensor()), name
        assert torch.equal(state["plain"], want["plain"]) and state["step"] == 1

    # Resharded (saved sharded, loaded replicated): not one stored chunk, so DCP plans it.
    where = f"{path}/fsdp"
    metadata = dcp.FileSystemReader(where).read_metadata()
    flat = meshes[0][1]
    state = dtensor_state(flat, [Replicate()], 3)
    planner = _load_plan.LoadPlanner()
    planner.set_up_planner(state, metadata, rank == 0)
    assert _load_plan.whole_plan(planner.state_dict, metadata.state_dict_metadata) is None
    dcp.load(state, storage_reader=dcp.FileSystemReader(where), planner=_load_plan.LoadPlanner())
    want = dtensor_state(flat, [Shard(0)], 1)
    for k in DTENSOR_KEYS:
        assert torch.equal(state[k].to_local(), want[k].full_tensor()), ("resharded", k)
    dist.barrier()


def test_dtensors_resumed_on_their_mesh_are_planned_as_dcp_plans_them(tmp_path: Path) -> None:
    """FSDP2 (``Shard(0)``, uneven shards, an empty one) and HSDP (``Replicate``, ``Shard``)
    states on 2 ranks: the plan made here has DCP's items (less reads of no bytes), resolves
    to the same shards and loads the saved values; a resharded load is DCP's to plan."""
    run_ranks(_dtensor_ranks, 2, str(tmp_path))


class _Opaque:
    """An object DCP stores pickled (not a scalar, tensor, dict or list)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque)

    __hash__ = object.__hash__


def _training_state(seed: int) -> dict[str, Any]:
    """A model's and an optimizer's state as a training loop hands them over: an OrderedDict of
    parameters, the optimizer's per-parameter state under int keys, its param groups a list of
    dicts (with a tuple of betas), and lists that DCP walks into or stores whole."""
    from collections import OrderedDict

    g = torch.Generator().manual_seed(seed)
    model = OrderedDict((f"layers.{i}.w", torch.randn(4, 3, generator=g)) for i in range(3))
    optim = {
        "state": {
            i: {"step": torch.tensor(5.0), "exp_avg": torch.randn(4, 3, generator=g)}
            for i in range(3)
        },
        "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0, 1, 2], "foreach": None}],
    }
    return {
        "model": model,
        "optim": optim,
        "step": 12,
        "tensors": [torch.randn(2, generator=g), [torch.randn(3, generator=g), 4]],
        "history": [[1.5, 2.5], [], "done"],
        "empty": {},
        "none": None,
    }


def _dcp_set_up(state: dict[str, Any]) -> DefaultLoadPlanner:
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state, None, True)
    return planner


def test_a_training_state_is_flattened_as_dcp_flattens_it() -> None:
    """The Checkpointer's planner flattens a state of dicts, lists and scalars itself (DCP's
    set-up walks it three times); the flattened state (its keys in DCP's order, the same
    objects) and the mappings equal DCP's, and a load through it restores every value."""
    state = _training_state(1)
    flat = _load_plan.flat_state(state)
    assert flat is not None  # flattened here, not by DCP
    theirs = _dcp_set_up(_training_state(1))
    assert list(flat[0]) == list(theirs.state_dict)
    assert flat[1] == theirs.mappings
    assert "optim.param_groups.0.betas" in flat[0] and "tensors.1.0" in flat[0]
    for key, value in flat[0].items():
        want = theirs.state_dict[key]
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, want), key
        else:
            assert value == want, key

    ours = _load_plan.LoadPlanner()
    ours.set_up_planner(state, None, True)
    assert ours.original_state_dict is state and ours.is_coordinator
    assert list(ours.state_dict) == list(flat[0])
    assert all(ours.state_dict[k] is v for k, v in flat[0].items())
    assert ours.mappings == theirs.mappings


def test_a_training_state_loads_through_the_flattening_as_through_dcps(tmp_path: Path) -> None:
    _saved(tmp_path, _training_state(1))
    ours, theirs = _training_state(2), _training_state(2)
    ours["optim"]["param_groups"][0]["lr"] = theirs["optim"]["param_groups"][0]["lr"] = 0.5
    _load(ours, tmp_path)
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    want = _training_state(1)
    assert ours["optim"]["param_groups"][0]["lr"] == 0.1  # the saved value, as DCP loads it
    flat_ours, flat_theirs, flat_want = (_dcp_set_up(s).state_dict for s in (ours, theirs, want))
    assert list(flat_ours) == list(flat_want)
    for key, value in flat_ours.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, flat_want[key]) and torch.equal(value, flat_theirs[key]), key
        else:
            assert value == flat_want[key] == flat_theirs[key], key


@pytest.mark.parametrize(
    "odd",
    [
        "a meta tensor",
        "an object",
        "a tuple holding a tensor",
        "a list holding an object",
        "a Mapping",
    ],
)
def test_any_other_state_is_flattened_by_dcp(odd: str) -> None:
    """What the flattening here does not take is DCP's to set up, with DCP's result."""
    from types import MappingProxyType

    value: Any = {
        "a meta tensor": torch.empty(3, device="meta"),
        "an object": _Opaque(),
        "a tuple holding a tensor": (torch.zeros(1), 2),
        "a list holding an object": [torch.zeros(1), _Opaque()],
        "a Mapping": MappingProxyType({"x": torch.zeros(1)}),
    }[odd]
    state = {"w": torch.zeros(2), "odd": value}
    assert _load_plan.flat_state(state) is None
    if odd == "a meta tensor":
        return  # (DCP makes it a real tensor on the process group's device: none here)
    ours = _load_plan.LoadPlanner()
    ours.set_up_planner(dict(state), None, True)
    theirs = _dcp_set_up(dict(state))
    assert list(ours.state_dict) == list(theirs.state_dict)
    assert ours.mappings == theirs.mappings


def test_two_paths_of_one_name_are_dcps_error() -> None:
    state = {"a.b": torch.zeros(1), "a": {"b": torch.ones(1)}}
    with pytest.raises(ValueError) as theirs:
        _dcp_set_up(dict(state))
    with pytest.raises(ValueError, match=re.escape(str(theirs.value))):
        _load_plan.LoadPlanner().set_up_planner(state, None, True)
