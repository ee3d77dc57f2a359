"""State dicts of every shape DCP accepts round-trip bit-exact, through a plain ``dcp.save``
(copied in ``write_data``) and through ``dcp.async_save`` (copied in ``stage``): empty and 0-d
tensors, non-contiguous tensors (transposed, strided slices, views with a storage offset, expanded,
channels-last), bytes items (picklable objects, ``io.BytesIO`` payloads, raw ``bytes``), None, and
nested dicts and lists that mix tensors with such values. Loads fill the destination's own tensors
in place, keeping their layout, as DCP does for torch's own readers; side by side with torch's
FileSystemWriter/Reader, a load leaves the destination as theirs does."""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tierckpt_client.dcp import TieredStorageReader, TieredStorageWriter

from helpers import DaemonProcess, started
from kit import save

UNLOADED = "<not loaded>"  # what a destination holds for a non-tensor value before the load


@pytest.fixture(scope="module")
def shared_daemon() -> Iterator[DaemonProcess]:
    """One daemon for the module: each test saves under a namespace of its own."""
    with started() as d:
        yield d


@pytest.fixture
def env(shared_daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> DaemonProcess:
    monkeypatch.setenv("TIERCKPT_SOCKET", str(shared_daemon.socket))
    return shared_daemon


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(12)
    base = torch.randn(6, 8, generator=g)
    wide = torch.randint(-(2**40), 2**40, (5, 7), dtype=torch.int64, generator=g)
    return {
        # empty tensors: several shapes and dtypes
        "empty": torch.empty(0),
        "empty_3x0": torch.empty(3, 0, dtype=torch.float64),
        "empty_0x4x2": torch.empty(0, 4, 2, dtype=torch.int64),
        "empty_slice": base[:, 8:],  # a 6x0 view of a non-empty storage
        # 0-d tensors
        "scalar_f": torch.tensor(3.25),
        "scalar_i": torch.tensor(-7, dtype=torch.int32),
        "scalar_b": torch.tensor(True),
        "scalar_bf16": torch.tensor(-0.5, dtype=torch.bfloat16),
        # non-contiguous
        "transposed": base.t(),
        "strided": base[::2, 1::3],
        "offset_view": base[2:, 3:],  # contiguous rows, storage offset != 0
        "int_stride": wide[:, ::2].t(),
        "expanded": torch.arange(5.0).expand(4, 5),
        "channels_last": torch.randn(2, 3, 4, 5, generator=g).to(memory_format=torch.channels_last),
        # bytes items
        "obj": {"epoch": 3, "lr": (0.1, 0.01), "name": "run-\u03b1", "set": {1, 2}},
        "blob": io.BytesIO(bytes(range(256)) * 3),
        "raw": b"\x00\xff" * 10,
        "none": None,
        "int": 42,
        "float": float("-inf"),
        "rng": torch.get_rng_state(),  # a uint8 tensor, as RNG states are saved
        # nested containers that mix both
        "nested": {
            "a": [torch.arange(4), {"b": torch.ones(2, 2, dtype=torch.float16)}, "text", None],
            "c": {"d": torch.full((3,), 2.5).t(), "e": io.BytesIO(b"inner"), "f": [1, [2, 3]]},
        },
    }


def _blank(v: Any) -> Any:
    """A destination for ``v``: tensors of its shape, dtype and strides holding other values;
    containers of blanks; UNLOADED for everything else."""
    if isinstance(v, torch.Tensor):
        if v.numel() and 0 in v.stride():
            return torch.full(v.shape, -1.0, dtype=v.dtype)  # an expanded view cannot be written
        out = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype)
        out.fill_(0 if v.dtype == torch.bool else 77)
        return out
    if isinstance(v, dict):
        return {k: _blank(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_blank(x) for x in v]
    return UNLOADED


def _assert_same(got: Any, want: Any, where: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), where
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want), where
    elif isinstance(want, io.BytesIO):
        assert isinstance(got, io.BytesIO) and got.getvalue() == want.getvalue(), where
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, (where, got, want)


def _tensors(obj: Any, where: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield where, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{where}.{k}")
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{where}[{i}]")


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_kind_of_value_round_trips_into_the_destinations_own_tensors(
    env: DaemonProcess, mode: str
) -> None:
    ns = f"kinds-{mode}"
    save(ns, 1, _state(), staged=mode != "sync")
    dest = _blank(_state())
    before = {where: (t, t.stride(), t.data_ptr()) for where, t in _tensors(dest)}
    dcp.load(dest, storage_reader=TieredStorageReader(ns, 1), no_dist=True)

    _assert_same(dest, _state(), "sd")
    # DCP copies into the tensors the caller gave it: same objects, same memory, same strides.
    after = dict(_tensors(dest))
    assert after.keys() == before.keys()
    for where, (t, stride, ptr) in before.items():
        assert after[where] is t and t.stride() == stride and t.data_ptr() == ptr, where
    assert dest["transposed"].stride() == (1, 8)
    assert dest["channels_last"].is_contiguous(memory_format=torch.channels_last)


def test_training_may_change_the_state_while_an_async_save_runs(env: DaemonProcess) -> None:
    """What ``async_save`` returns for is a snapshot: the values at the call, non-tensor ones too."""
    sd = _state()
    fut = dcp.async_save(
        sd,
        storage_writer=TieredStorageWriter("snapshot", 1),
        async_checkpointer_type=AsyncCheckpointerType.THREAD,
        no_dist=True,
    )
    sd["transposed"].mul_(-1)  # the base storage of several views
    sd["nested"]["a"][0].add_(100)
    sd["obj"]["epoch"] = 99
    sd["nested"]["c"]["f"][1].append(4)
    fut.result()
    dest = _blank(_state())
    dcp.load(dest, storage_reader=TieredStorageReader("snapshot", 1), no_dist=True)
    _assert_same(dest, _state(), "sd")


def test_a_state_dict_of_only_non_tensor_values_round_trips(env: DaemonProcess) -> None:
    sd = {"step": 7, "blob": io.BytesIO(b""), "none": None, "cfg": {"k": [1, "v"]}}
    save("no-tensors", 1, sd, staged=False)
    dest = {"step": UNLOADED, "blob": UNLOADED, "none": UNLOADED, "cfg": {"k": UNLOADED}}
    dcp.load(dest, storage_reader=TieredStorageReader("no-tensors", 1), no_dist=True)
    _assert_same(dest, sd, "sd")


def test_a_state_dict_of_only_empty_tensors_round_trips(env: DaemonProcess) -> None:
    sd = {"a": torch.empty(0, 3), "b": torch.zeros(2, 0, 5, dtype=torch.int8)}
    for mode in ("sync", "async"):
        save(f"empties-{mode}", 1, sd, staged=mode != "sync")
        dest = {"a": torch.ones(0, 3), "b": torch.ones(2, 0, 5, dtype=torch.int8)}
        dcp.load(dest, storage_reader=TieredStorageReader(f"empties-{mode}", 1), no_dist=True)
        _assert_same(dest, sd, mode)


@pytest.mark.parametrize("flatten", [True, False])
def test_a_load_gives_what_torchs_own_file_system_reader_gives(
    env: DaemonProcess, tmp_path: Path, flatten: bool
) -> None:
    """Side by side with torch's FileSystemWriter/Reader, the same state and planners: the same
    destination afterwards (with flatten_state_dict=False too, where DCP stores nested containers
    as one bytes item each and puts what it loads into its own copy of the state dict)."""
    ns = f"side-by-side-{flatten}"
    dcp.save(
        _state(),
        storage_writer=FileSystemWriter(tmp_path),
        planner=DefaultSavePlanner(flatten_state_dict=flatten),
        no_dist=True,
    )
    dcp.save(
        _state(),
        storage_writer=TieredStorageWriter(ns, 1),
        planner=DefaultSavePlanner(flatten_state_dict=flatten),
        no_dist=True,
    )
    theirs, ours = _blank(_state()), _blank(_state())
    dcp.load(
        theirs,
        storage_reader=FileSystemReader(tmp_path),
        planner=DefaultLoadPlanner(flatten_state_dict=flatten),
        no_dist=True,
    )
    dcp.load(
        ours,
        storage_reader=TieredStorageReader(ns, 1),
        planner=DefaultLoadPlanner(flatten_state_dict=flatten),
        no_dist=True,
    )
    _assert_same(ours, theirs, "sd")
    if flatten:
        _assert_same(ours, _state(), "sd")
