"""Peers over links that are slow or cut off rather than dead (issue 32): a real daemon behind a
loopback proxy with latency, and peers that accept and never answer (tests/loopback_faults.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Members, Membership

from helpers import DaemonProcess, free_port, new_shm_dir
from loopback_faults import DelayProxy

TOKEN = "peer-token-for-the-link-tests-0123456789"
NS = "links"
UVICORN_DEFAULT_KEEPALIVE_S = 5.0  # what the daemon's server kept idle connections before


@pytest.fixture
def daemon() -> Iterator[str]:
    """A daemon's peer address."""
    port = free_port()
    d = DaemonProcess(new_shm_dir(), port=port, peers=f"127.0.0.1:{port}", peer_token=TOKEN)
    try:
        d.start()
        yield f"127.0.0.1:{port}"
    finally:
        d.cleanup()


def _client(peer: str, timeout_s: float = 5.0) -> PeerClient:
    return PeerClient(TOKEN, members=Members(Membership.parse(peer), peer), timeout_s=timeout_s)


def test_a_request_on_a_connection_idle_just_under_the_keepalive_succeeds(daemon: str) -> None:
    """Over a link with 100 ms of latency each way, a request sent on a pooled connection idle
    just under the server's old keep-alive (5 s) reached the server after it had closed the
    connection: "Server disconnected without sending a response", and a healthy peer was taken
    for unreachable. The client lets idle connections go well before any server does."""
    with DelayProxy(daemon, 0.1) as link:
        client = _client(link.address)
        try:
            assert client.list_steps(link.address, NS) == []  # opens the pooled connection
            time.sleep(UVICORN_DEFAULT_KEEPALIVE_S - 0.05)
            assert client.list_steps(link.address, NS) == []
        finally:
            client.close()
