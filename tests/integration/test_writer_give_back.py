"""A failed save's writer gives its file back when it is collected, wherever the garbage collector
finds it: also in the middle of a call on the trainer thread's shared daemon connection (whose
lock is not reentrant), where giving back from that same thread would wait for the lock forever."""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
import torch

from tierckpt_client import DaemonClient
from tierckpt_client.dcp import TieredStorageWriter

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
