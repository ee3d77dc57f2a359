"""Peers over links that are slow or cut off rather than dead (issue 32): real daemons, behind a
loopback proxy with latency or one that drops everything from some request on, and ring members
that never answer (tests/loopback_faults.py). A save or a restore's first call that one such
node touches ends within one peer timeout (or the listing timeout) plus a margin."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from tierckpt_client import Checkpointer, DaemonClient
from tierckpt_core.errors import PeerUnavailableError, TierCkptError
from tierckpt_core.protocol import CommitRequest
from tierckpt_daemon.peers.client import PeerClient
from tierckpt_daemon.peers.membership import Members, Membership

from helpers import DaemonProcess, free_port, new_shm_dir, running, wait_until
from kit import seal_bytes
from loopback_faults import DelayProxy, SilentPeer

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


def _latest(d: DaemonProcess) -> int | None:
    with DaemonClient.from_socket(d.socket) as c:
        steps = [s.step for s in c.steps(NS) if s.state.value != "writing"]
    return max(steps) if steps else None


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


# -- a node that does not answer holds nothing for longer than one peer timeout ----------------

PEER_TIMEOUT_S = 4.0
LIST_TIMEOUT_S = 1.0
MARGIN_S = 2.5  # the work itself on this box (2 cores, other tests beside)


@pytest.fixture
def cut_off() -> Iterator[tuple[DaemonProcess, DaemonProcess, SilentPeer, SilentPeer]]:
    """Daemons A and B on a ring with two members that never answer: one accepts connections
    and holds them, the other's accept queue is full (connects hang)."""
    with SilentPeer(accept=True) as held, SilentPeer(accept=False) as full:
        ports = [free_port(), free_port()]
        members = [f"127.0.0.1:{p}" for p in ports] + [held.address, full.address]
        nodes = [
            DaemonProcess(
                new_shm_dir(),
                port=port,
                host="127.0.0.1",
                node_name=f"127.0.0.1:{port}",
                peers=",".join(members),
                peer_token=TOKEN,
                replicas=0,
                peer_timeout_s=PEER_TIMEOUT_S,
                peer_list_timeout_s=LIST_TIMEOUT_S,
                log_level="INFO",
            )
            for port in ports
        ]
        with running(nodes) as (a, b):
            yield a, b, held, full


def test_a_save_whose_participant_does_not_answer_fails_within_one_peer_timeout(
    cut_off: tuple[DaemonProcess, DaemonProcess, SilentPeer, SilentPeer],
) -> None:
    """Before, the prepare's timeout was followed by three tries of the abort to the silent
    node, one after the other (4 timeouts); now the aborts go on in the background."""
    a, b, held, full = cut_off
    assert a.name and b.name
    for step, silent in ((1, held), (2, full)):
        seal_bytes(a, NS, step, f"s{step}", 0, 10_000)
        seal_bytes(b, NS, step, f"s{step}", 1, 10_000)
        req = CommitRequest(
            files=["r00000.data", "r00001.data", "r00002.data"],
            metadata={"what": "test"},
            world_size=3,
            nodes={"r00000.data": a.name, "r00001.data": b.name, "r00002.data": silent.address},
        )
        t0 = time.monotonic()
        with DaemonClient.from_socket(a.socket) as c, pytest.raises(TierCkptError) as err:
            c.commit(NS, step, f"s{step}", req)
        took = time.monotonic() - t0
        assert silent.address in str(err.value) and "nothing was committed" in str(err.value)
        assert took < PEER_TIMEOUT_S + MARGIN_S, f"step {step} failed after {took:.1f} s"


def test_latest_does_not_wait_for_peers_that_do_not_answer(
    cut_off: tuple[DaemonProcess, DaemonProcess, SilentPeer, SilentPeer],
) -> None:
    """A restore's first call asks the ring neighbours which steps they hold: it decides on
    those that answered within TIERCKPT_PEER_LIST_TIMEOUT_S and names the others."""
    a, _, held, full = cut_off
    name, _ = seal_bytes(a, NS, 1, "s1", 0, 10_000)
    with DaemonClient.from_socket(a.socket) as c:
        c.commit(NS, 1, "s1", CommitRequest(files=[name], metadata={"what": "test"}, world_size=1))
        for _ in range(2):  # the second time, the silent peers are not waited for again
            t0 = time.monotonic()
            assert [s.step for s in c.candidates(NS)] == [1]
            took = time.monotonic() - t0
            assert took < LIST_TIMEOUT_S + MARGIN_S, f"candidates took {took:.1f} s"
    warned = [line for line in a.log().splitlines() if "did not answer within" in line]
    assert warned and held.address in warned[0] and full.address in warned[0], warned


def test_a_restore_that_finds_nothing_while_peers_do_not_answer_is_not_a_fresh_start(
    cut_off: tuple[DaemonProcess, DaemonProcess, SilentPeer, SilentPeer],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node whose memory holds nothing of the job (replaced, or its share's steps are on
    others) asks its peers; when some do not answer, its daemon said "no committed step ...
    nor do its peers hold one", and the trainer took it for a first start: the job trained
    again from scratch, with an INFO, while the silent peers held its steps (a network blip at
    a restart). The restore now fails naming them, and nothing is restored."""
    a, _, held, full = cut_off
    monkeypatch.setenv("TIERCKPT_SOCKET", str(a.socket))
    state = {"w": torch.zeros(4)}
    with Checkpointer("job") as ckpt, pytest.raises(PeerUnavailableError) as err:
        ckpt.restore(state)
    text = str(err.value)
    assert "namespace job: no committed step found" in text, text
    assert held.address in text and full.address in text and "not a fresh start" in text, text
    assert torch.equal(state["w"], torch.zeros(4))


def test_a_save_whose_participant_is_cut_off_after_prepare_is_acknowledged_in_one_timeout() -> None:
    """C prepares, then every packet to it is dropped, from the decision on: the decider
    acknowledges the save within one peer timeout (before: three tries of the decision, one
    after the other) and C, which still reaches the decider, settles the step by asking."""
    ports = [free_port() for _ in range(3)]
    real = [f"127.0.0.1:{p}" for p in ports]
    with DelayProxy(real[2], 0.0, cut_on=b"/commit HTTP/1.1") as link:
        members = ",".join([*real[:2], link.address])
        nodes = [
            DaemonProcess(
                new_shm_dir(),
                port=port,
                host="127.0.0.1",
                node_name=name,
                peers=members,
                peer_token=TOKEN,
                replicas=0,
                peer_timeout_s=PEER_TIMEOUT_S,
                log_level="INFO",
            )
            for port, name in zip(ports, [*real[:2], link.address], strict=True)
        ]
        with running(nodes) as (a, b, c):
            for rank, d in enumerate((a, b, c)):
                seal_bytes(d, NS, 1, "s1", rank, 10_000)
            req = CommitRequest(
                files=["r00000.data", "r00001.data", "r00002.data"],
                metadata={"what": "test"},
                world_size=3,
                nodes={"r00000.data": real[0], "r00001.data": real[1], "r00002.data": link.address},
            )
            t0 = time.monotonic()
            with DaemonClient.from_socket(a.socket) as client:
                client.commit(NS, 1, "s1", req)
            took = time.monotonic() - t0
            assert link.cut.is_set()  # the decision to C was dropped
            assert took < PEER_TIMEOUT_S + MARGIN_S, f"acknowledged after {took:.1f} s"
            wait_until("C to settle step 1", lambda: _latest(c) == 1, 60)
