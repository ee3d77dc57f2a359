"""A restore from this node's memory of a step this process read before gets small answers from its
daemon: the step's metadata and file records (their block checksums are most of a step's record)
come once per commit, not on every load (issue 24, goal 2). What it holds of a step is of one
commit: a step saved again is read as saved again; and a reader that never reads (a probe for the
step) leaves no pin behind."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader

from helpers import DaemonProcess
from kit import blank_state, load, save, seeded_state


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, str, bool]]]:
    """Every request this process made to a daemon, as (method, last part of the path, whether
    the answer carried a step's metadata or file records)."""
    made: list[tuple[str, str, bool]] = []
    real = DaemonClient._request

    def counted(self: DaemonClient, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        doc = real(self, method, path, *args, **kwargs)
        last = path.rsplit("/", 1)[-1] if method != "DELETE" else "pin"
        big = isinstance(doc, dict) and (
            "state_dict_metadata" in doc
            or doc.get("metadata") is not None
            or bool(doc.get("files") or doc.get("step", {}).get("files"))
        )
        made.append((method, last, big))
        return doc

    monkeypatch.setattr(DaemonClient, "_request", counted)
    yield made


def test_a_restore_of_a_step_read_before_gets_small_answers(
    client_env: DaemonProcess, answers: list[tuple[str, str, bool]]
) -> None:
    save("trips", 1, seeded_state(1, 4096))
    step, out = load("trips", blank_state(4096), 1)  # the first: metadata and records come along
    assert step == 1 and torch.equal(out["w"], seeded_state(1, 4096)["w"])
    assert any(big for _, _, big in answers)
    answers.clear()
    step, out = load("trips", blank_state(4096), 1)
    assert step == 1 and torch.equal(out["w"], seeded_state(1, 4096)["w"])
    # The pin (read_data; read_metadata found the step's commit record unchanged: see
    # test_restore_unchanged), the unpin: none with the step's record.
    assert answers == [("POST", "reads", False), ("DELETE", "pin", False)]


def test_a_step_saved_again_is_read_as_saved_again(client_env: DaemonProcess) -> None:
    save("again", 3, seeded_state(3, 4096))
    assert torch.equal(load("again", blank_state(4096), 3)[1]["w"], seeded_state(3, 4096)["w"])
    save("again", 3, seeded_state(3, 4096, seed=99))  # overwrite=True: the same step, new bytes
    _, out = load("again", blank_state(4096), 3)
    assert torch.equal(out["w"], seeded_state(3, 4096, seed=99)["w"])


def test_a_reader_dropped_before_it_reads_leaves_no_pin(make_node: Any) -> None:
    node = make_node(client=True, keep_last=1)
    save("probe", 1, seeded_state(1, 4096))
    probe = TieredStorageReader("probe")
    assert probe.read_metadata() is not None  # pins step 1 for a read that never comes
    del probe
    gc.collect()
    save("probe", 2, seeded_state(2, 4096))  # keep_last=1: step 1 leaves memory at this commit
    with DaemonClient() as c:
        assert [s.step for s in c.steps("probe") if s.in_memory] == [2], node.socket


def test_a_step_saved_again_while_it_is_loaded_fails_the_load_naming_it(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP plans a load with the metadata ``read_metadata`` returned; a step saved again before
    ``read_data`` pins it (another layout: "w" at another offset) is not read at the old offsets
    (its new checksums would pass: the tensor would silently get the wrong bytes)."""
    save("resaved", 5, seeded_state(5, 4096))
    other = {"a": torch.ones(100), **seeded_state(6, 4096)}
    real = TieredStorageReader.read_data

    def saved_again_first(self: TieredStorageReader, plan: Any, planner: Any) -> Any:
        save("resaved", 5, other)
        return real(self, plan, planner)

    monkeypatch.setattr(TieredStorageReader, "read_data", saved_again_first)
    with pytest.raises(CheckpointException, match="saved again while it was being loaded"):
        load("resaved", blank_state(4096), 5)
    monkeypatch.setattr(TieredStorageReader, "read_data", real)
    _, out = load("resaved", blank_state(4096), 5)  # loaded again: the step as saved again
    assert torch.equal(out["w"], other["w"])
