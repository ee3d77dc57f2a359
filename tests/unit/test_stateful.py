"""The cheap ``Stateful`` test and the load built on it agree with torch DCP's own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
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


@pytest.mark.parametrize("inner", [True, False], ids=["torch-inner", "dcp-load"])
def test_load_matches_dcp_load(tmp_path: Path, inner: bool, monkeypatch: Any) -> None:
    if not inner:  # torch without the inner function as expected: dcp.load itself
        monkeypatch.setattr(_stateful, "_inner_load", lambda: None)
    else:
        assert _stateful._inner_load() is not None  # this torch has it
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
