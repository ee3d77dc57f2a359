"""Partial and strict loads: a destination with fewer keys than the checkpoint loads what it has;
one with a key the checkpoint lacks loads with ``allow_partial_load=True`` (that key untouched)
and otherwise fails naming the key; a destination whose shape differs from the stored tensor
fails naming the key and both shapes. Nothing is half-loaded by a load that fails. A destination
of another dtype gets the stored values converted, as with torch's own reader."""

from __future__ import annotations

import io
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException

from helpers import DaemonProcess, started
from kit import load, save

NS = "partial"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {
        "model": {
            "w": torch.randn(4, 6, generator=g),
            "b": torch.randn(6, generator=g),
            "emb": torch.randint(0, 1000, (8, 3), generator=g),
        },
        "step": 17,
        "loader": io.BytesIO(b"position=1234"),
    }


@pytest.fixture(scope="module")
def saved() -> Iterator[DaemonProcess]:
    """One daemon for the module, holding one checkpoint of ``_state()``."""
    with started() as d:
        save(NS, 1, _state(), node=d, staged=False)
        yield d


@pytest.fixture
def env(saved: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> DaemonProcess:
    monkeypatch.setenv("TIERCKPT_SOCKET", str(saved.socket))
    return saved


def _failure(info: pytest.ExceptionInfo[CheckpointException]) -> str:
    """The text of the one rank's error DCP wrapped."""
    ((err, _),) = info.value.failures.values()
    return str(err)


def test_a_destination_with_some_of_the_keys_loads_only_those(env: DaemonProcess) -> None:
    want = _state()
    dest: dict[str, Any] = {"model": {"b": torch.zeros(6)}, "step": None}
    load(NS, dest, 1)
    assert dest.keys() == {"model", "step"} and dest["model"].keys() == {"b"}
    assert torch.equal(dest["model"]["b"], want["model"]["b"])
    assert dest["step"] == 17


def test_allow_partial_load_skips_keys_the_checkpoint_lacks(env: DaemonProcess) -> None:
    want = _state()
    head = torch.full((2, 2), 9.0)
    dest: dict[str, Any] = {
        "model": {"w": torch.zeros(4, 6), "head": head},  # "head" is not in the checkpoint
        "loader": None,
        "new_counter": 0,
    }
    load(NS, dest, 1, planner=DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(dest["model"]["w"], want["model"]["w"])
    assert dest["loader"].getvalue() == b"position=1234"
    assert dest["model"]["head"] is head and torch.equal(head, torch.full((2, 2), 9.0))
    assert dest["new_counter"] == 0


@pytest.mark.parametrize("missing", ["model.head", "new_counter"])
def test_a_key_the_checkpoint_lacks_fails_a_strict_load_naming_it(
    env: DaemonProcess, missing: str
) -> None:
    w = torch.zeros(4, 6)
    dest: dict[str, Any] = {"model": {"w": w}}
    if missing == "model.head":
        dest["model"]["head"] = torch.zeros(2)
    else:
        dest["new_counter"] = 0
    with pytest.raises(CheckpointException) as info:
        load(NS, dest, 1)
    assert f"Missing key in checkpoint state_dict: {missing}" in _failure(info)
    assert torch.equal(w, torch.zeros(4, 6))  # the plan failed: nothing was read


def test_a_shape_mismatch_fails_naming_the_key_and_both_shapes(env: DaemonProcess) -> None:
    w = torch.zeros(6, 4)  # stored as 4x6
    with pytest.raises(CheckpointException) as info:
        load(NS, {"model": {"w": w, "b": torch.zeros(6)}}, 1)
    text = _failure(info)
    assert "model.w" in text and "[4, 6]" in text and "[6, 4]" in text, text
    assert torch.equal(w, torch.zeros(6, 4))


def test_a_destination_of_another_dtype_gets_the_values_converted(env: DaemonProcess) -> None:
    """As torch's own reader does: DCP copies the stored tensor into the destination's dtype."""
    want = _state()["model"]
    dest = {
        "model": {
            "w": torch.zeros(4, 6, dtype=torch.float64),
            "b": torch.zeros(6, dtype=torch.bfloat16),
            "emb": torch.zeros(8, 3, dtype=torch.int32),
        }
    }
    load(NS, dest, 1)
    for k, t in dest["model"].items():
        assert torch.equal(t, want[k].to(t.dtype)), k
    assert dest["model"]["w"].dtype == torch.float64
