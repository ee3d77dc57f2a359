"""The handoff socket (``tierckpt_daemon.peers.handoff``) gives a trainer one deadline for its whole
request line, not a timeout per read: a client that sends a byte every so often used to hold its
slot for as long as it went on, and :data:`~tierckpt_daemon.peers.handoff.MAX_CONNECTIONS` such clients
blocked every restore on the node. A real daemon, its deadline shortened by its setting."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from tierckpt_core.protocol import handoff_socket
from tierckpt_daemon.peers.handoff import MAX_CONNECTIONS

from helpers import DaemonProcess, ring, running

TOKEN = "peer-token-for-the-handoff-deadline-tests-0123"
DEADLINE_S = 2.0
REQUEST = {
    "peer": "127.0.0.1:9",
    "namespace": "job",
    "step": 1,
    "attempt": "a1",
    "file": "f",
    "start": 0,
    "stop": 1,
}


@pytest.fixture
def node() -> Iterator[DaemonProcess]:
    with running(ring(1, token=TOKEN, handoff_timeout_s=DEADLINE_S)) as nodes:
        yield nodes[0]


def _connect(d: DaemonProcess) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(60)
    s.connect(str(handoff_socket(d.socket)))
    return s


def _read_to_end(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(4096):
            data += chunk
    except ConnectionResetError:
        pass  # closed with bytes of ours unread: the end, too
    return data


def test_a_client_that_stops_midway_is_answered_at_the_deadline(node: DaemonProcess) -> None:
    with _connect(node) as s:
        s.sendall(b'{"peer": ')  # and nothing more
        doc = json.loads(_read_to_end(s))
    assert not doc["ok"] and doc["code"] == "protocol"
    assert f"no whole line within {DEADLINE_S:g}s" in doc["detail"]
    assert "TIERCKPT_HANDOFF_TIMEOUT_S" in doc["detail"]


def test_trickling_clients_lose_their_slots_at_the_deadline(node: DaemonProcess) -> None:
    # Every slot taken by a client that sends one byte every half second, never a whole line.
    slow = [_connect(node) for _ in range(MAX_CONNECTIONS)]
    opened = time.monotonic()
    closed_after: dict[int, float] = {}
    stop = threading.Event()

    def trickle() -> None:
        byte = b"{"
        while not stop.is_set() and len(closed_after) < len(slow):
            for i, s in enumerate(slow):
                if i in closed_after:
                    continue
                readable, _, _ = select.select([s], [], [], 0)
                try:
                    if readable:
                        _read_to_end(s)
                        raise ConnectionResetError
                    s.sendall(byte)
                except OSError:
                    closed_after[i] = time.monotonic() - opened
            byte = b" "
            stop.wait(0.5)

    trickler = threading.Thread(target=trickle, daemon=True)
    trickler.start()
    try:
        # Meanwhile another trainer is served (here: told that 127.0.0.1:9 is no peer).
        with _connect(node) as s:
            s.sendall(json.dumps(REQUEST).encode() + b"\n")
            doc = json.loads(s.recv(4096))
        assert not doc["ok"] and "is not one of this daemon's peers" in doc["detail"], doc
        trickler.join(timeout=60)
        # Every trickling client was cut off, at the deadline rather than when it gave up.
        assert len(closed_after) == len(slow), f"{len(slow) - len(closed_after)} still open"
        assert max(closed_after.values()) < 30 * DEADLINE_S
    finally:
        stop.set()
        trickler.join(timeout=10)
        for s in slow:
            s.close()
