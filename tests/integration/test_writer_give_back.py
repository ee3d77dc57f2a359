"""A failed save's writer gives its file back when it is collected, wherever the garbage collector
finds it: also in the middle of a call on the trainer thread's shared daemon connection (whose
lock is not reentrant), where giving back from that same thread would wait for the lock forever."""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

import pytest
import torch

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageWriter
from tierckpt_client.dcp.targets.base import OutFile
from tierckpt_client.dcp.targets.memory import release_lease

from helpers import DaemonProcess


def _wait_for(cond: Any, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_writer_collected_inside_a_daemon_call_gives_its_file_back(
    client_env: DaemonProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = DaemonClient.from_socket(client_env.socket)
    writer = TieredStorageWriter("collected", step=1)
    writer.stage({"w": torch.ones(1 << 16)})  # leases its file; the save never goes on
    assert client.status().leased_bytes > 0

    # This thread is inside a daemon call: it holds the connection's lock, as httpx's pool does
    # while it sends a request, when the collector runs the writer's finalizer.
    connection = threading.Lock()
    connection.acquire()
    stuck: list[str] = []
    real_release = DaemonClient.release

    def release(self: DaemonClient, namespace: str, lease_id: str) -> None:
        if not connection.acquire(timeout=5):  # on the collecting thread: a deadlock
            stuck.append(threading.current_thread().name)
            return
        try:
            real_release(self, namespace, lease_id)
        finally:
            connection.release()

    monkeypatch.setattr(DaemonClient, "release", release)
    del writer
    gc.collect()
    connection.release()
    assert not stuck, "the file was given back from the thread that held the connection"
    assert _wait_for(lambda: client.status().leased_bytes == 0), "the staged file was not released"


def test_giving_back_a_lease_the_daemon_no_longer_has_is_not_a_warning(
    client_env: DaemonProcess, caplog: pytest.LogCaptureFixture
) -> None:
    """After a daemon restart the leases it had granted are gone: giving one back is what was
    wanted, not something to warn about (a tolerant loop printed "could not release lease ...:
    no lease ..." at its exit). A release that fails otherwise is still a warning."""
    client = DaemonClient.from_socket(client_env.socket)
    lease = client.lease("gone", 0, 1 << 16)
    f = OutFile("r00000.data", lease.size, lease_id=lease.lease_id, path=lease.path)
    client_env.restart()
    caplog.set_level(logging.INFO, "tierckpt_client.dcp.targets.memory")
    release_lease(DaemonClient.from_socket(client_env.socket), "gone", f)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert "was already given back" in caplog.text
    client_env.stop()
    caplog.clear()
    release_lease(DaemonClient.from_socket(client_env.socket, timeout_s=2), "gone", f)
    assert [r for r in caplog.records if r.levelno == logging.WARNING], caplog.text
