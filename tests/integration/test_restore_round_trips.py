"""A restore from this node's memory asks its daemon once before it reads (the pin, with the step's
metadata and file records unless this process holds them already) and waits for nothing after
(the pin is released off its path): the fixed cost of a small restore (issue 24, goal 2). What it
holds of a step is of one commit: a step saved again is read as saved again; and a reader that
never reads (a probe for the step) leaves no pin behind."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tierckpt_client.daemon_client import DaemonClient
from tierckpt_client.dcp import TieredStorageReader

from helpers import DaemonProcess
from kit import blank_state, load, save, seeded_state


@pytest.fixture
def requests(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[bool, str, str]]]:
    """Every request this process made to a daemon, as it was answered: (from the main thread,
    method, last part of the path)."""
    made: list[tuple[bool, str, str]] = []
    real = DaemonClient._request

    def counted(self: DaemonClient, method: str, path: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return real(self, method, path, *args, **kwargs)
        finally:
            last = path.rsplit("/", 1)[-1] if method != "DELETE" else "pin"
            made.append((threading.current_thread() is threading.main_thread(), method, last))

    monkeypatch.setattr(DaemonClient, "_request", counted)
    yield made


def test_a_restore_asks_the_daemon_once(
    client_env: DaemonProcess, requests: list[tuple[bool, str, str]]
) -> None:
    save("trips", 1, seeded_state(1, 4096))
    step, out = load("trips", blank_state(4096), 1)  # the first: metadata and records come along
    assert step == 1 and torch.equal(out["w"], seeded_state(1, 4096)["w"])
    with DaemonClient() as c:
        c.status()  # the first load's pin is released by now
    requests.clear()
    step, out = load("trips", blank_state(4096), 1)
    assert step == 1 and torch.equal(out["w"], seeded_state(1, 4096)["w"])
    # On the load's path: one request. The pin is released in the background ...
    assert [(m, p) for main, m, p in requests if main] == [("POST", "reads")]
    with DaemonClient() as c:  # ... and for sure before anything else this process asks
        c.status()
    assert requests[1:] == [
        (False, "DELETE", "pin"),
        (True, "GET", "status"),
    ]


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
