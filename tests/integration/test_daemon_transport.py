"""How the trainer's client talks to its daemon (issue 24, goal 2): a load's pin is released when the
load returns, whether it read its step or failed (its release is not waited for on the load's
path, yet whatever this process asks next sees it released); a daemon that is gone, or was
restarted under a kept-alive connection, is a clear error or no error at all, never a leaked
socket."""

from __future__ import annotations

import logging
import os
import re
import resource
import time

import pytest
import torch
import uvicorn
from torch.distributed.checkpoint.api import CheckpointException

from tierckpt_client import DaemonClient
from tierckpt_client._uds_http import IDLE_EXPIRY_S
from tierckpt_core.errors import DaemonUnavailableError

from helpers import DaemonProcess
from kit import blank_state, flip_byte, load, save, seeded_state


def _in_memory(ns: str) -> list[int]:
    with DaemonClient() as c:
        return [s.step for s in c.steps(ns) if s.in_memory]


def test_a_loads_pin_is_released_when_it_returns_read_or_failed(make_node: object) -> None:
    """With ``keep_last=1`` a commit takes the step before it out of memory unless a reader
    still pins it: right after a load returns, the next save's commit does."""
    make_node(client=True, keep_last=1)  # type: ignore[operator]
    save("pins", 1, seeded_state(1, 1 << 16))
    step, out = load("pins", blank_state(1 << 16), 1)
    assert step == 1 and torch.equal(out["w"], seeded_state(1, 1 << 16)["w"])
    save("pins", 2, seeded_state(2, 1 << 16))
    assert _in_memory("pins") == [2]

    # A load that fails (a flipped byte in memory) holds nothing either.
    with DaemonClient() as c:
        pin = c.pin("pins", 2)
        c.unpin("pins", 2, pin.pin_id)
    paths = pin.paths
    name, data = next((n, p) for n, p in paths.items() if n.endswith(".data"))
    flip_byte(data, 1000)
    with pytest.raises(CheckpointException, match=rf"{re.escape(name)}.*block 0"):
        load("pins", blank_state(1 << 16), 2)
    save("pins", 3, seeded_state(3, 1 << 16))
    assert _in_memory("pins") == [3]


def test_a_release_the_daemon_refuses_is_logged(
    client_env: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """A release sent off the load's path that the daemon refuses is not lost silently: the
    warning comes with this process's next request."""
    save("gone", 1, seeded_state(1, 1024))
    with DaemonClient() as c:
        c.unpin("gone", 1, "0" * 32, wait=False)  # no such pin
        with caplog.at_level(logging.WARNING):
            assert [s.step for s in c.steps("gone")] == [1]
    assert any(f"pins/{'0' * 32} failed" in r.getMessage() for r in caplog.records)


def test_a_daemon_that_went_away_is_a_clear_error(make_node: object) -> None:
    """A load after the daemon stopped, on a process that kept a connection to it: the error
    names the socket and what to check (no leaked socket: warnings are errors here)."""
    node = make_node(client=True)  # type: ignore[operator]
    save("away", 1, seeded_state(1, 1024))
    load("away", blank_state(1024), 1)
    node.stop(timeout=30)
    with pytest.raises(
        DaemonUnavailableError,
        match=f"cannot reach the tierckpt daemon at {node.socket}.*is it running",
    ):
        DaemonClient.shared().steps("away")
    with pytest.raises(CheckpointException, match="cannot reach the tierckpt daemon"):
        load("away", blank_state(1024), 1)


def test_a_connection_the_daemon_closed_is_not_reused(make_node: object) -> None:
    """The daemon restarted between two loads of a process: the kept-alive connection is dead,
    and the next load opens a new one instead of failing."""
    node = make_node(client=True)  # type: ignore[operator]
    save("restart", 1, seeded_state(1, 1024))
    load("restart", blank_state(1024), 1)
    node.restart()
    step, out = load("restart", blank_state(1024), 1)
    assert step == 1 and torch.equal(out["w"], seeded_state(1, 1024)["w"])


def test_idle_connections_expire_well_before_the_servers_keep_alive(
    client_env: DaemonProcess,
) -> None:
    """A connection idle past the server's keep-alive is closed by the server; the client stops
    reusing its own well before (a request on one the server is closing would fail)."""
    margin = uvicorn.Config(app="tierckpt_daemon:app").timeout_keep_alive - IDLE_EXPIRY_S
    assert margin >= 2
    c = DaemonClient.shared()
    save("idle", 1, seeded_state(1, 1024))
    time.sleep(IDLE_EXPIRY_S + 0.5)
    assert [s.step for s in c.steps("idle")] == [1]


def test_a_process_with_many_open_descriptors_reuses_its_connection(
    client_env: DaemonProcess,
) -> None:
    """A trainer holds many descriptors (data loaders, communicators): a kept-alive connection
    numbered above 1024 is checked and reused like any other (``select`` cannot watch it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on open files is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    held = []
    try:
        while not held or held[-1] < 1100:
            held.append(os.open(os.devnull, os.O_RDONLY))
        save("fds", 1, seeded_state(1, 1024))
        with DaemonClient() as c:  # its connection is numbered above 1100
            assert [s.step for s in c.steps("fds")] == [1]
            assert [s.step for s in c.steps("fds")] == [1]  # reused
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
