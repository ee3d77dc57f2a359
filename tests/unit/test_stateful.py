"""The cheap ``Stateful`` test and the load built on it agree with torch DCP's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from tierckpt_client import _stateful


class Counter:
    def __init__(self, n: int = 0) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor([self.n])}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n = int(sd["n"].item())


class StatefulDict(dict):  # a builtin's subclass that adds the methods is still Stateful
    def state_dict(self) -> dict[str, Any]:
        return {"v": self["v"]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self["v"] = sd["v"]
        self["loaded"] = True


def test_is_stateful_answers_as_the_protocol_does() -> None:
    module = torch.nn.Linear(2, 2)
    values = [
        torch.zeros(2),
        torch.nn.Parameter(torch.zeros(2)),
        {"a": 1},
        [1],
        (1,),
        "s",
        b"b",
        1,
        1.5,
        True,
        None,
        object(),
        module,
        torch.optim.SGD(module.parameters(), lr=0.1),
        Counter(),
        StatefulDict(v=torch.ones(1)),
    ]
    for v in values:
        assert _stateful.is_stateful(v) == isinstance(v, Stateful), type(v)
    assert _stateful.is_stateful(StatefulDict()) and _stateful.is_stateful(module)


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, generator=g),
        "nested": {"a": torch.randn(3, 5, generator=g), "b": torch.randn(7, generator=g)},
        "model": torch.nn.Linear(4, 3),
        "count": Counter(seed + 5),
        "box": StatefulDict(v=torch.randn(9, generator=g)),
    }


def _inner_or_not(inner: bool, monkeypatch: Any) -> None:
    if not inner:  # torch without the inner functions as expected: dcp.load and dcp.save
        monkeypatch.setattr(_stateful, "_inner", lambda *args: None)
    else:  # this torch has them
        assert _stateful._inner(state_dict_loader, "_load_state_dict", "storage_reader")
        assert _stateful._inner(state_dict_saver, "_save_state_dict", "storage_writer")


@pytest.mark.parametrize("inner", [True, False], ids=["torch-inner", "dcp-load"])
def test_load_matches_dcp_load(tmp_path: Path, inner: bool, monkeypatch: Any) -> None:
    _inner_or_not(inner, monkeypatch)
    torch.manual_seed(0)
    saved = _state(1)
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(saved, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True)

    ours, theirs = _state(2), _state(2)
    model_weight = ours["model"].weight
    _stateful.load(
        ours,
        storage_reader=dcp.FileSystemReader(str(tmp_path)),
        process_group=None,
        no_dist=True,
    )
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)

    for got in (ours, theirs):
        assert torch.equal(got["w"], saved["w"])
        assert torch.equal(got["nested"]["a"], saved["nested"]["a"])
        assert torch.equal(got["nested"]["b"], saved["nested"]["b"])
        assert torch.equal(got["model"].weight, saved["model"].weight)
        assert torch.equal(got["model"].bias, saved["model"].bias)
        assert got["count"].n == 6  # load_state_dict was called
        assert got["box"]["loaded"] is True and torch.equal(got["box"]["v"], saved["box"]["v"])
    assert ours["model"].weight is model_weight  # a Stateful is loaded in place
    assert ours.keys() == theirs.keys()


def test_load_fails_on_a_missing_key_as_dcp_does(tmp_path: Path) -> None:
    with pytest.warns(UserWarning):
        dcp.save(
            {"w": torch.ones(3)}, storage_writer=dcp.FileSystemWriter(str(tmp_path)), no_dist=True
        )
    with pytest.raises(CheckpointException) as caught:
        _stateful.load(
            {"w": torch.zeros(3), "extra": torch.zeros(1)},
            storage_reader=dcp.FileSystemReader(str(tmp_path)),
            process_group=None,
            no_dist=True,
        )
    (why,) = caught.value.failures.values()
    assert "Missing key in checkpoint state_dict: extra" in str(why)


@pytest.mark.parametrize("inner", [True, False], ids=["torch-inner", "dcp-save"])
def test_save_matches_dcp_save(tmp_path: Path, inner: bool, monkeypatch: Any) -> None:
    """The same step as ``dcp.save``'s: the same metadata, and the same values loaded back
    (``Stateful`` ones saved as their state dicts)."""
    _inner_or_not(inner, monkeypatch)
    torch.manual_seed(0)
    state = _state(3)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    meta = _stateful.save(
        state,
        storage_writer=dcp.FileSystemWriter(str(ours)),
        process_group=None,
        no_dist=True,
    )
    with pytest.warns(UserWarning, match="single process"):
        want = dcp.save(state, storage_writer=dcp.FileSystemWriter(str(theirs)), no_dist=True)
    assert meta.state_dict_metadata == want.state_dict_metadata
    for where in (ours, theirs):
        got = _state(4)
        with pytest.warns(UserWarning, match="single process"):
            dcp.load(got, storage_reader=dcp.FileSystemReader(str(where)), no_dist=True)
        assert torch.equal(got["w"], state["w"])
        assert torch.equal(got["nested"]["a"], state["nested"]["a"])
        assert torch.equal(got["model"].weight, state["model"].weight)
        assert got["count"].n == 8
        assert torch.equal(got["box"]["v"], state["box"]["v"])
